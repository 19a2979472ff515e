# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The coordinator's model-free suite: no vLLM, no model, no engine.

`fake_engine`, `call_engine` and `reference` are this folder's helpers,
found through `pythonpath` in common/pyproject.toml.
"""
