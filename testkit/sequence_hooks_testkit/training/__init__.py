# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The test kit's part for the embedded toy model (models/expand): its
task, from which models/research/train_promise_model.py makes training data,
and its measurement through the hooked engine.

Modules: `expand_task` (the task, shared by training, evaluation, the demo
and their tests), `expand_eval` (accuracy and whether conclusions follow
the merged results).
"""
