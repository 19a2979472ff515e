# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Critical-path scheduling: under contention the work a parked tree waits
for goes before new requests and is preempted last, within a bound on how
long a new request may be passed over.

The first tests play steps on the real scheduler through `HookHarness`
(sampled tokens chosen by the test); the last ones run the tiny model on
the real engine with scripted programs and check the order of the steps
and the outputs against a roomy engine.
"""

import time

import pytest

from sequence_hooks_testkit.engines import (assert_engine_clean, run_hooked,
                                            tiny_llm)
from sequence_hooks_testkit.harness import make_harness
from sequence_hooks_testkit.oracle import scripted
from sequence_hooks_testkit.priority_case import (ADMITTED, ARRIVALS, CHILD,
                                                  PLAIN_WAITING, PRIORITY,
                                                  WAITING)
from sequence_hooks_testkit.schedule_recorder import ScheduleRecorder
from vllm import SamplingParams
from vllm.config import SpecialKwargs

PROMPT = "the cat sees the dog"


def params(max_tokens=64):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def children_of(group):
    return group.first_seq.promise_tree.tree.root.children


def waiting_ids(harness):
    return [group.request_id for group in harness.scheduler.waiting]


def two_slots_taken(tokenizer_path, ids, **hook_options):
    """A harness with `max_num_seqs` = 2, both slots taken by requests
    "parent" and "busy" after their prefill.

    Returns:
        The harness and the parent's group.
    """
    harness = make_harness(tokenizer_path, ids, {"max_num_seqs": 2},
                           **hook_options)
    parent = harness.add("parent", PROMPT, params())
    harness.add("busy", PROMPT, params())
    harness.step()
    return harness, parent


@pytest.mark.parametrize("critical_path_first", [True, False])
def test_child_of_a_parked_parent_is_admitted_before_a_new_request(
        tiny_tokenizer_path, hook_ids, critical_path_first):
    harness, parent = two_slots_taken(tiny_tokenizer_path,
                                      hook_ids,
                                      critical_path_first=critical_path_first)
    harness.add("new", PROMPT, params())
    harness.step({"parent": hook_ids.promise})
    [child_id] = [node.request_id for node in children_of(parent)]
    # Stock order: the new request came first.
    assert waiting_ids(harness) == ["new", child_id]
    harness.step({"parent": hook_ids.sync})

    # The parked parent freed one slot.
    scheduled = {s.request_id for s in harness.step()}
    if critical_path_first:
        assert child_id in scheduled and "new" not in scheduled
        assert waiting_ids(harness) == ["new"]
        assert harness.scheduler.hooks.order.steps_passed_over["new"] == 1
    else:
        assert "new" in scheduled and child_id not in scheduled
        assert waiting_ids(harness) == [child_id]


@pytest.mark.parametrize("bound, new_arrived_first, goes_first", [
    (3, True, "new"),
    (64, True, "child"),
    (3, False, "child"),
])
def test_new_request_is_passed_over_at_most_for_the_bound(
        tiny_tokenizer_path, hook_ids, bound, new_arrived_first, goes_first):
    """Once passed over for the bound, a request goes before the trees of
    requests that arrived after it, never before earlier ones'."""
    harness, parent = two_slots_taken(tiny_tokenizer_path,
                                      hook_ids,
                                      max_steps_passed_over=bound)
    # Added after the parent, as the engine got it; its arrival time says
    # when it arrived.
    harness.add("new",
                PROMPT,
                params(),
                arrival_time=parent.arrival_time +
                (-1.0 if new_arrived_first else 1.0))
    for _ in range(3):
        harness.step({"parent": hook_ids.promise})
    first, second, third = [node.request_id for node in children_of(parent)]
    harness.step({"parent": hook_ids.sync})
    assert "new" not in harness.scheduler.hooks.order.steps_passed_over

    # Three steps with the first child running: the new request waits
    # behind the other two children each time.
    for _ in range(3):
        scheduled = {s.request_id for s in harness.step()}
        assert first in scheduled and "new" not in scheduled
    assert harness.scheduler.hooks.order.steps_passed_over["new"] == 3
    assert waiting_ids(harness) == [second, third, "new"]
    harness.step({first: hook_ids.eos})

    # A slot is free again.
    scheduled = {s.request_id for s in harness.step()}
    if goes_first == "new":
        assert "new" in scheduled and second not in scheduled
        assert waiting_ids(harness) == [second, third]
    else:
        assert second in scheduled and "new" not in scheduled
        assert waiting_ids(harness) == [third, "new"]


@pytest.mark.parametrize("critical_path_first", [True, False])
def test_new_request_is_preempted_before_a_child_of_a_parked_parent(
        tiny_tokenizer_path, hook_ids, critical_path_first):
    harness = make_harness(tiny_tokenizer_path,
                           hook_ids, {
                               "num_gpu_blocks": 8,
                               "block_size": 4
                           },
                           critical_path_first=critical_path_first)
    harness.add("new", PROMPT, params())
    parent = harness.add("parent", PROMPT, params())
    harness.step()
    harness.step({"parent": hook_ids.promise})
    [child_id] = [node.request_id for node in children_of(parent)]
    harness.step({"parent": hook_ids.sync})
    # Stock order puts the child, which joined last, at the back: the
    # first to be preempted.
    assert [g.request_id
            for g in harness.scheduler.running] == ["new", child_id]

    for _ in range(20):
        harness.step()
        if harness.last_outputs.preempted:
            break
    else:
        raise AssertionError("the cache never ran out")
    preempted = {"new", child_id} & set(waiting_ids(harness))
    assert preempted == ({"new"} if critical_path_first else {child_id})


def test_children_take_their_roots_arrival_time_and_priority(
        tiny_tokenizer_path, hook_ids):
    harness = make_harness(tiny_tokenizer_path, hook_ids,
                           {"policy": "priority"})
    root = harness.add("root", PROMPT, params(), priority=3)
    harness.step()
    harness.step({"root": hook_ids.promise})
    child = harness.live_group(children_of(root)[0].request_id)
    harness.step({child.request_id: hook_ids.promise})
    grandchild = harness.live_group(
        children_of(root)[0].children[0].request_id)
    for group in (child, grandchild):
        assert group.arrival_time == root.arrival_time
        assert group.metrics.arrival_time == root.arrival_time
        assert group.priority == 3


@pytest.mark.parametrize("critical_path_first", [True, False])
def test_with_the_priority_policy_priority_then_arrival_decide(
        tiny_tokenizer_path, hook_ids, critical_path_first):
    """The priority rule's case (`priority_case`) on V0's scheduler, as
    `v1/tests/test_v1_critical_path.py` plays it on V1's; the rule holds
    with `critical_path_first` on or off."""
    harness, parent = priority_case_arrived(
        tiny_tokenizer_path, hook_ids, critical_path_first=critical_path_first)
    harness.step({"parent": hook_ids.promise})
    assert [node.request_id for node in children_of(parent)] == [CHILD]
    harness.step({"parent": hook_ids.sync})

    scheduled = {s.request_id for s in harness.step()}
    assert scheduled == {"busy", ADMITTED}
    assert waiting_ids(harness) == WAITING


@pytest.mark.parametrize("critical_path_first", [True, False])
def test_with_the_priority_policy_plain_requests_wait_by_priority(
        tiny_tokenizer_path, hook_ids, critical_path_first):
    """The plain case (`priority_case`): upstream's chunked-prefill
    scheduler ignores the policy, the hooks' order does not."""
    harness, _ = priority_case_arrived(tiny_tokenizer_path,
                                       hook_ids,
                                       critical_path_first=critical_path_first)
    assert {s.request_id for s in harness.step()} == {"parent", "busy"}
    assert waiting_ids(harness) == PLAIN_WAITING


def priority_case_arrived(tokenizer_path, ids, **hook_options):
    """`priority_case`'s engine after its arrivals: the harness, and the
    parent's group."""
    harness = make_harness(tokenizer_path, ids, {
        "max_num_seqs": 2,
        "policy": "priority"
    }, **hook_options)
    parent = harness.add("parent", PROMPT, params(), priority=PRIORITY)
    harness.add("busy", PROMPT, params(), priority=PRIORITY)
    harness.step()
    for request_id, priority, after_parent in ARRIVALS:
        harness.add(request_id,
                    PROMPT,
                    params(),
                    priority=priority,
                    arrival_time=parent.arrival_time + after_parent)
    return harness, parent


@pytest.mark.parametrize("field, value, message", [
    ("max_steps_passed_over", 0, "max_steps_passed_over must be >= 1"),
    ("max_steps_passed_over", 1.5, "valid integer"),
    ("critical_path_first", "yes", "valid boolean"),
])
def test_bad_scheduling_options_are_refused(hook_ids, field, value, message):
    with pytest.raises(ValueError, match=message):
        SpecialKwargs(sync_token_id=hook_ids.sync,
                      promise_token_id=hook_ids.promise,
                      **{field: value})


# On the real engine: two running slots, one parent whose children must
# queue, a long plain request holding the other slot, and a new request that
# arrives before the children do.
NUM_CHILDREN = 4
CHILD_TOKENS = 12
BOUND = 5


@pytest.fixture(scope="module")
def two_slot_llm(tiny_model_path, hook_ids):
    return tiny_llm(tiny_model_path,
                    special_kwargs=SpecialKwargs(
                        sync_token_id=hook_ids.sync,
                        promise_token_id=hook_ids.promise,
                        child_role_token_id=hook_ids.child,
                        max_steps_passed_over=BOUND),
                    max_num_seqs=2)


def contended_programs(ids):
    fan_out = {
        (): [None] + [ids.promise] * NUM_CHILDREN + [ids.sync] + [None] * 4,
        **{
            (i, ): [None] * CHILD_TOKENS
            for i in range(NUM_CHILDREN)
        }
    }
    return [fan_out, {(): [None] * 60}, {(): [None] * 8}]


def test_engine_orders_children_first_within_the_bound(two_slot_llm,
                                                       hooked_llm, hook_ids):
    engine = two_slot_llm.llm_engine
    prompts = ["the cat sees", "one two three", "big red dog"]
    plans = contended_programs(hook_ids)

    def add(i, arrival_time):
        engine.add_request(
            f"r{i}",
            prompts[i],
            SamplingParams(temperature=0.0,
                           max_tokens=64,
                           logits_processors=[scripted(plans[i], hook_ids)]),
            arrival_time=arrival_time)

    outputs = {}
    with ScheduleRecorder(engine.scheduler[0]) as recorder:
        start = time.time()
        add(0, start)
        add(1, start)
        engine.step()
        # The new request reaches the engine while both slots are taken,
        # before the parent's first promise; it arrived before the parent's
        # request (at a server, say), so the bound lets it go before the
        # parent's later children.
        add(2, start - 1.0)
        for _ in range(500):
            if not engine.has_unfinished_requests():
                break
            outputs.update(
                (o.request_id, o) for o in engine.step() if o.finished)
    first_step = {}
    for index, step in enumerate(recorder.steps):
        for chunk in step.chunks:
            first_step.setdefault(chunk.request_id, index)
    children = sorted((first_step[r], r) for r in first_step if "/" in r)
    assert len(children) == NUM_CHILDREN
    # The first child went ahead of the earlier new request; once that had
    # waited behind children for the bound, it went before the rest.
    assert children[0][0] < first_step["r2"] < children[1][0]
    # Same outputs as on a roomy engine.
    roomy = run_hooked(hooked_llm, hook_ids, prompts, plans)
    for i, expected in enumerate(roomy):
        got = outputs[f"r{i}"]
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        assert got.outputs[0].finish_reason == "stop"
    engine.step()  # the engine forgets finished ids at its next step
    assert_engine_clean(two_slot_llm)
