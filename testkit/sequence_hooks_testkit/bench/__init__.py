# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The test kit's part for benchmarks (benchmarks/v0/, benchmarks/v1/) and
the demo's picture.

Modules: `runs` (what the benchmarks share: the V0 CPU set-up, a tiny test
model, runs and reports), `client_join` and `client_join_http` (the
client-side join on a stock engine, in-process and over HTTP: the peer the
hooks are measured against), `http_sides` (the V1 benchmarks' servers,
workload and measured runs over HTTP), `timeline` (a promise tree's run
over engine steps, drawn by the demo and for docs/benchmarks.md).
"""
