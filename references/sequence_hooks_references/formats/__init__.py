# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The published parallel-reasoning formats' own controllers, as client
joins over stock vLLM (docs/formats.md).

Modules:
- `threadweaver_controller`: ThreadWeaver's outlines and threads (token
  ids), and `run_threadweaver`, which runs it in a process of its own;
- `threadweaver_simple_eval`: ThreadWeaver's evaluation controller
  (text), with `run_threadweaver_simple_eval`;
- `apr_controller`: APR's sub-searches (text), with `apr_trace`, its
  trace grammar, and `run_apr`;
- `driver`: runs controllers written as generators of calls, many at once;
- `backends`: stock vLLM offline (`LLM.generate`) or over the OpenAI
  completions API, or a scripted model;
- `golden`: the formats' golden traces (common/tests/golden/), written by
  the controllers over scripted models.

The controllers are the yardstick of the engine's formats: they parse,
build prompts and join with code of their own, written from the formats'
reference repositories, and import nothing of `sequence_hooks`
(common/tests/test_formats_golden.py checks). ThreadWeaver's text pieces
and the scripted models the tests drive them with are the test kit's
(`sequence_hooks_testkit.formats`).
"""
