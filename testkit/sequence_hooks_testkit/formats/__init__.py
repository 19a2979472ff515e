# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The test kit's side of the parallel-reasoning formats: what the format
tests run and script (the controllers themselves are the references',
`sequence_hooks_references.formats`).

Modules:
- `run_in_engine`: a format's cases run in the hooked V1 engine, in a
  process of its own (the in-engine side of the controllers' runners);
- `sides`: a toy's cases run on both sides, each runner in a process of
  its own;
- `toy_server`: a hooked or stock `vllm serve` of a format toy model;
- `threadweaver_toy`: models/threadweaver-toy as the model-free tests
  read it (tokenizer, ids, a prompt);
- `splice_toy`: NPR's and Multiverse's toys as the model-free splice
  tests read them, and their scripted greedy model;
- `threadweaver_format`: ThreadWeaver's format as text (outline labels,
  thread headers and closure, what a join appends), which the reference
  controller and models/threadweaver-toy's task share;
- `apr_scripts` and `threadweaver_scripts`: the scripted APR searches and
  the scripted ThreadWeaver model the model-free tests use.
"""
