# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End-to-end: scripted promise/sync programs on the real hooked engine.

Each program is forced through a per-request logits processor; the
results are compared token for token with the hook-free reference built on
a plain engine (the equivalence oracle), and every test checks that the
engine is left clean: all KV blocks free, no parked group, no registered
child.
"""

import dataclasses

import pytest

from sequence_hooks_testkit import conformance
from sequence_hooks_testkit.engines import V0, assert_engine_clean, run_hooked
from sequence_hooks_testkit.oracle import scripted
from sequence_hooks_testkit.programs import NONE, programs
from sequence_hooks_testkit.schedule_recorder import ScheduleRecorder
from vllm import SamplingParams


class TestConformance(conformance.FlavourConformance):
    """The checks every flavour passes, on V0."""
    flavour = V0


def test_aborting_a_request_aborts_its_tree(hooked_llm, hook_ids):
    engine = hooked_llm.llm_engine
    plans = {(): [hook_ids.promise, hook_ids.sync], (0, ): [NONE] * 40}
    params = SamplingParams(temperature=0.0,
                            max_tokens=64,
                            logits_processors=[scripted(plans, hook_ids)])
    engine.add_request("abort-me", {"prompt_token_ids": [7, 8, 9]}, params)
    for _ in range(5):
        engine.step()
    scheduler = engine.scheduler[0]
    assert "abort-me" in scheduler.parked
    assert len(engine.seq_id_to_seq_group) == 1
    engine.abort_request("abort-me")
    engine.step()
    assert_engine_clean(hooked_llm)


def test_scheduled_tokens_for_child_start_and_parent_resume(
        hooked_llm, hook_ids):
    plans = programs(hook_ids)["sync before the child finishes"]
    with ScheduleRecorder(hooked_llm.llm_engine.scheduler[0]) as recorder:
        [output] = run_hooked(hooked_llm, hook_ids, ["the cat sees"], [plans])
    root_id = output.request_id
    [child] = output.promise_tree.children
    child_chunks = recorder.chunks_of(child.request_id)
    root_chunks = recorder.chunks_of(root_id)
    # The child computes only <promise> and its role marker, then decodes.
    assert child_chunks[0] == (2, True)
    assert all(chunk == (1, False) for chunk in child_chunks[1:])
    # The parent: its prompt, one decode (<promise>), then, after waiting,
    # exactly <sync> plus the merged tokens, then decodes.
    merged = output.promise_tree.num_merged_tokens
    assert merged > 0
    assert root_chunks[:3] == [(len(output.prompt_token_ids), True),
                               (1, False), (1 + merged, True)]
    assert all(chunk == (1, False) for chunk in root_chunks[3:])
    assert_engine_clean(hooked_llm)


def test_prompt_logprobs_cover_the_prompt_only(hooked_llm, plain_llm,
                                               hook_ids):
    plans = programs(hook_ids)["sync before the child finishes"]
    params = SamplingParams(temperature=0.0,
                            max_tokens=32,
                            prompt_logprobs=1,
                            logits_processors=[scripted(plans, hook_ids)])
    [output] = hooked_llm.generate(["the cat sees"], params, use_tqdm=False)
    [plain] = plain_llm.generate(["the cat sees"],
                                 SamplingParams(max_tokens=1,
                                                prompt_logprobs=1),
                                 use_tqdm=False)
    assert output.promise_tree.num_merged_tokens > 0
    assert len(output.prompt_logprobs) == len(output.prompt_token_ids)
    assert [
        None if p is None else sorted(p) for p in output.prompt_logprobs
    ] == [None if p is None else sorted(p) for p in plain.prompt_logprobs]
    assert_engine_clean(hooked_llm)


def test_outputs_carry_snapshots_that_never_change(hooked_llm, hook_ids):
    engine = hooked_llm.llm_engine
    plans = programs(hook_ids)["sync before the child finishes"]
    engine.add_request(
        "snapshot", {"prompt_token_ids": [7, 8, 9]},
        SamplingParams(temperature=0.0,
                       max_tokens=64,
                       logits_processors=[scripted(plans, hook_ids)]))
    trees = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.promise_tree is not None:
                trees.append(output.promise_tree)
    # The first tree a caller got shows the child running, for good.
    early, final = trees[0], trees[-1]
    assert early.children[0].finish_reason is None
    assert early.children[0].token_ids == ()
    assert final.children[0].finish_reason == "stop"
    assert final.children[0].token_ids and final.num_merged_tokens > 0
    assert final.children[0].parent is final
    with pytest.raises(dataclasses.FrozenInstanceError):
        final.children[0].text = "changed"
    assert_engine_clean(hooked_llm)


def test_engine_abort_leaves_no_child_counted(hooked_llm, hook_ids):
    engine = hooked_llm.llm_engine
    running_before = conformance.hook_metric(hooked_llm, "children_running")
    plans = {
        (): [hook_ids.promise, hook_ids.promise, NONE, NONE],
        (0, ): [NONE] * 40,
        (1, ): [NONE] * 40
    }
    engine.add_request(
        "abort-counted", {"prompt_token_ids": [7, 8, 9]},
        SamplingParams(temperature=0.0,
                       max_tokens=64,
                       logits_processors=[scripted(plans, hook_ids)]))
    for _ in range(4):
        engine.step()
    assert conformance.hook_metric(hooked_llm,
                                   "children_running") == running_before + 2
    engine.abort_request("abort-counted")
    engine.step()
    assert conformance.hook_metric(hooked_llm,
                                   "children_running") == running_before
    assert_engine_clean(hooked_llm)


class EosBan:
    """A logits processor with no `clone`: parent and children share it."""

    def __init__(self, eos_id: int, min_len: int):
        self.eos_id = eos_id
        self.min_len = min_len
        self.calls = 0

    def __call__(self, output_ids, logits):
        self.calls += 1
        if len(output_ids) < self.min_len:
            logits[self.eos_id] = -float("inf")
        return logits


def test_logits_processor_without_clone_is_shared(hooked_llm, hook_ids):
    plans = programs(hook_ids)["one promise"]
    shared = EosBan(hook_ids.eos, min_len=3)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=64,
        logits_processors=[scripted(plans, hook_ids), shared])
    [output] = hooked_llm.generate(["the cat sees"], params, use_tqdm=False)
    [child] = output.promise_tree.children
    # SamplingParams.clone keeps objects without `clone`: the one object
    # ran for the parent's sampled tokens and the child's.
    parent_sampled = len(plans[()]) + 1
    assert shared.calls == parent_sampled + len(child.token_ids)
    assert_engine_clean(hooked_llm)
