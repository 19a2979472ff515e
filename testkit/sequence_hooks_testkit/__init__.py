# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The test kit: what the two test suites (mytests/ for V0, v1/tests/ for
V1) share, split by audience.

This package is for the tests (and is what the other parts build on):
`tiny_model` (a tiny Llama and word-level tokenizer with the hook tokens,
`HookIds`), `scripted_hooks` (programs forced per request), `programs` (the
named programs), `oracle` (the hook-free reference, either flavour),
`conformance` (the checks both flavours pass, as a test class each suite
subclasses), `engines` (V0 test engines and checks, its `Flavour`),
`harness` (the model-free engine loop), `schedule_recorder` (what each step
scheduled), `server` (`vllm serve` on loopback), `served` (a hooked and a
stock server for the fault tests), `shared_servers` (servers the tests of
several modules share), `cli_forks` (`vllm` command lines, vLLM imported
once for them all), `run_programs` (the programs in a process of their
own), `priority_case` (the priority rule's case both suites play),
`cache` (the project's per-user cache); for the V1 flavour
only: `v1_engines` (its engines,
checks and `Flavour`), `v1_scripted_logits` (programs as V1 logits
processors) and `v1_batch_queue` (a model-free V1 engine core).

Subpackage `formats`: the formats' test-side scripts (the in-engine
runner, the toy server and models, ThreadWeaver's text, scripted models).

The other audiences have packages of their own, built on this one and
never imported by it: the formats' reference controllers and the
client-side join (`sequence_hooks_references`, references/), the
benchmark clients (`sequence_hooks_bench`, benchmarks/clients/) and the
models' tasks (`sequence_hooks_training`, training/).
"""
