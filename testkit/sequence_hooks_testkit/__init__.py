# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fork's test kit, shared by tests, benchmarks, tools and the demo.

Modules: `tiny_model` (a tiny Llama and word-level tokenizer with the hook
tokens, `HookIds`), `scripted_hooks` (programs forced per request),
`programs` (the named programs), `oracle` (the hook-free reference),
`engines` (test engines and checks), `harness` (the model-free engine
loop), `schedule_recorder` (what each step scheduled), `server` (`vllm
serve` on loopback), `bench` (what the benchmarks share) and `expand_task`
(the task of the embedded model).
"""
