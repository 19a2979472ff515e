# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The published parallel-reasoning formats' own controllers, as client
joins over stock vLLM (docs/formats.md).

Modules:
- `threadweaver_controller`: ThreadWeaver's outlines and threads (token
  ids), and `run_threadweaver`, which runs it in a process of its own;
- `apr_controller`: APR's sub-searches (text);
- `driver`: runs controllers written as generators of calls, many at once;
- `backends`: stock vLLM offline (`LLM.generate`) or over the OpenAI
  completions API.
"""
