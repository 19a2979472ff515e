# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The references: parallel reasoning run by a client on stock vLLM, the
yardsticks the engine's hooks and formats are held against (not shipped).

- `formats`: the published formats' own controllers (ThreadWeaver's and
  APR's), their runners and backends, and the golden traces they write;
  they import nothing of `sequence_hooks`;
- `client_join` (in-process) and `client_join_http` (over HTTP): the
  client-side join of promise/sync on a stock engine, run by the hooks'
  own lifecycle: the peer the benchmarks measure the hooks against;
- `parallel_layout` (the attention layout NPR's and Multiverse's models
  are trained with, as served: positions, 4-D mask, forced tokens) and
  `layout_check` (a Hugging Face model's greedy check of an answer under
  it, and the sequential reference decoder); they need torch when their
  tensors are asked for, and import nothing of `sequence_hooks`.

Used by the tests (common/tests, v1/tests, mytests), the benchmarks
(`sequence_hooks_bench`, benchmarks/) and training/research's evaluation
scripts. Built on the test kit (`sequence_hooks_testkit`: the formats'
text and scripted models) and never imported by it.
"""
