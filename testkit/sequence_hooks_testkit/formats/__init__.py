# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The published parallel-reasoning formats' own controllers, as client
joins over stock vLLM (docs/formats.md).

Modules:
- `threadweaver_controller`: ThreadWeaver's outlines and threads;
- `backends`: stock vLLM offline (`LLM.generate`) or over the OpenAI
  completions API, with token-id prompts.
"""
