# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The benchmark clients: what the benchmarks (benchmarks/v0/,
benchmarks/v1/) share, and the demo's picture.

Modules: `runs` (the V0 CPU set-up, a tiny test model, runs and reports),
`http_sides` (the V1 benchmarks' servers, workload and measured runs over
HTTP, the client-side join among them), `timeline` (a promise tree's run
over engine steps, drawn by examples/demo.py and for
docs/benchmarks.md).

Built on the references (`sequence_hooks_references.client_join`, the
peer the hooks are measured against), the training tasks
(`sequence_hooks_training`) and the test kit; nothing below imports it.
"""
