# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fork's test kit, shared by tests, benchmarks, tools and the demo.

Modules: `tiny_model` (a tiny Llama and word-level tokenizer with the hook
tokens, `HookIds`), `scripted_hooks` (programs forced per request),
`programs` (the named programs), `oracle` (the hook-free reference, either
flavour), `conformance` (the checks both flavours pass, as a test class
each suite subclasses), `engines` (V0 test engines and checks, its
`Flavour`), `harness` (the model-free engine loop), `schedule_recorder`
(what each step scheduled), `timeline` (the demo's picture), `server`
(`vllm serve` on loopback), `served` (a hooked and a stock server for the
fault tests), `bench` (what the benchmarks share), `client_join` and
`client_join_http` (the client-side join on a stock engine, in-process and
over HTTP: the benchmarks' peer), `expand_task` and `expand_eval` (the
embedded model's task and its measurement); for the V1 flavour only:
`v1_engines` (its engines, checks and `Flavour`) and `v1_scripted_logits`
(programs as V1 logits processors).
"""
