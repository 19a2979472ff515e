# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Surgical tests of the hook processor on the real scheduler, no model.

Each test plays engine steps through `HookHarness`, choosing the sampled
tokens, and checks the scheduler's queues, the block tables, the sequences'
tokens and stages, and the promise tree.
"""

import pytest

from sequence_hooks_testkit.harness import make_harness
from vllm.sampling_params import SamplingParams
from vllm.sequence import SequenceStage, SequenceStatus

PROMPT = "the cat sees the dog"


@pytest.fixture
def harness(tiny_tokenizer_path, hook_ids):
    return make_harness(tiny_tokenizer_path, hook_ids)


def word(harness, text: str) -> int:
    return harness.tokenizer.convert_tokens_to_ids(text)


def start(harness, request_id="0", max_tokens=32):
    """Adds a request and runs its prefill; it samples "the"."""
    group = harness.add(request_id, PROMPT,
                        SamplingParams(temperature=0.0, max_tokens=max_tokens))
    harness.step()
    return group


def children_of(group):
    return group.first_seq.promise_tree.tree.root.children


def test_promise_spawns_a_child_sharing_the_parents_blocks(harness, hook_ids):
    free_before = harness.free_blocks()
    parent = start(harness)
    harness.step({"0": hook_ids.promise})

    [child_node] = children_of(parent)
    child = harness.live_group(child_node.request_id)
    assert child is not parent
    assert child.first_seq.get_token_ids() == parent.first_seq.get_token_ids()
    assert child.first_seq.get_last_token_id() == hook_ids.promise
    # Forked block table: the same physical blocks, nothing allocated.
    assert harness.block_ids(child) == harness.block_ids(parent)
    assert harness.free_blocks() == free_before - len(
        harness.block_ids(parent))
    # Registered so that aborting request "0" reaches it.
    assert harness.seq_id_to_seq_group[child.request_id].group_id == "0"
    assert child_node.fork_position == parent.first_seq.get_output_len()

    # Both compute only the <promise> token; the shared, partly filled last
    # block is copied on write.
    scheduled = harness.step()
    assert {(s.request_id, s.num_tokens, s.is_prompt)
            for s in scheduled} == {("0", 1, False),
                                    (child.request_id, 1, False)}
    assert harness.last_outputs.blocks_to_copy
    parent_blocks, child_blocks = (harness.block_ids(parent),
                                   harness.block_ids(child))
    assert parent_blocks[:-1] == child_blocks[:-1]
    assert parent_blocks[-1] != child_blocks[-1]


def test_child_budget_counts_from_its_fork_point(harness, hook_ids):
    parent = start(harness, max_tokens=10)
    harness.step({"0": hook_ids.promise})
    child = harness.live_group(children_of(parent)[0].request_id)
    fork_len = parent.first_seq.get_output_len()
    assert child.sampling_params.max_tokens == 10 + fork_len
    assert parent.sampling_params.max_tokens == 10


def test_sync_parks_the_parent_until_its_child_finishes(harness, hook_ids):
    parent = start(harness)
    harness.step({"0": hook_ids.promise})
    child_id = children_of(parent)[0].request_id
    harness.step({"0": hook_ids.sync})

    assert parent.first_seq.status == SequenceStatus.BLOCKED
    assert not parent.is_finished()
    assert harness.scheduler.parked == {"0": parent}
    assert parent not in harness.scheduler.running
    blocks = harness.block_ids(parent)

    cat = word(harness, "cat")
    scheduled = harness.step({child_id: cat})
    assert [s.request_id for s in scheduled] == [child_id]
    assert harness.block_ids(parent) == blocks

    harness.step({child_id: hook_ids.eos})
    child_node = children_of(parent)[0]
    assert child_node.finish_reason == "stop"
    # The child sampled "the" (while its parent synced), "cat", EOS.
    assert child_node.token_ids == [word(harness, "the"), cat, hook_ids.eos]
    assert child_node.text.split() == ["the", "cat"]

    # Merged and resumed: <sync> plus the merged tokens are uncomputed.
    seq = parent.first_seq
    assert seq.status == SequenceStatus.RUNNING
    assert parent in harness.scheduler.running and not harness.scheduler.parked
    assert seq.get_output_token_ids()[-3:] == (hook_ids.sync,
                                               word(harness, "the"), cat)
    assert seq.data.get_num_uncomputed_tokens() == 3
    # Until the next schedule the engine still sees this step's decode.
    assert seq.data.stage == SequenceStage.DECODE
    assert parent.first_seq.promise_tree.tree.root.num_merged_tokens == 2

    scheduled = harness.step()
    assert [(s.request_id, s.num_tokens, s.is_prompt)
            for s in scheduled] == [("0", 3, True)]
    assert seq.data.stage == SequenceStage.DECODE
    assert [(s.num_tokens, s.is_prompt)
            for s in harness.step()] == [(1, False)]


def test_sync_after_children_finished_merges_at_once(harness, hook_ids):
    parent = start(harness)
    harness.step({"0": hook_ids.promise})
    child_id = children_of(parent)[0].request_id
    harness.step({child_id: hook_ids.eos})
    assert children_of(parent)[0].is_finished

    harness.step({"0": hook_ids.sync})
    seq = parent.first_seq
    assert seq.status == SequenceStatus.RUNNING
    assert not harness.scheduler.parked
    # The child sampled only EOS: an empty text merges as no tokens.
    assert seq.get_last_token_id() == hook_ids.sync
    assert [(s.num_tokens, s.is_prompt)
            for s in harness.step()] == [(1, False)]


def test_sync_without_children_is_an_ordinary_token(harness, hook_ids):
    parent = start(harness)
    harness.step({"0": hook_ids.sync})
    assert parent.first_seq.status == SequenceStatus.RUNNING
    assert parent.first_seq.promise_tree is None
    assert [(s.num_tokens, s.is_prompt)
            for s in harness.step()] == [(1, False)]


def test_children_merge_in_promise_order_with_the_separator(
        tiny_tokenizer_path, hook_ids):
    harness = make_harness(tiny_tokenizer_path,
                           hook_ids,
                           merge_separator=" and ")
    parent = start(harness)
    harness.step({"0": hook_ids.promise})
    first = children_of(parent)[0].request_id
    harness.step({"0": hook_ids.promise})
    second = children_of(parent)[1].request_id
    # The second child finishes first; order still follows the promises.
    cat, dog = word(harness, "cat"), word(harness, "dog")
    harness.step({"0": hook_ids.sync, first: cat, second: dog})
    harness.step({first: cat, second: hook_ids.eos})
    assert parent.first_seq.status == SequenceStatus.BLOCKED
    harness.step({first: hook_ids.eos})
    seq = parent.first_seq
    assert seq.status == SequenceStatus.RUNNING
    merged = seq.get_output_token_ids()[-5:]
    assert seq.get_output_token_ids()[-6] == hook_ids.sync
    assert harness.tokenizer.decode(merged).split() == [
        "the", "cat", "cat", "and", "dog"
    ]


def test_parent_finishing_aborts_its_live_children(harness, hook_ids):
    free_before = harness.free_blocks()
    parent = start(harness)
    harness.step({"0": hook_ids.promise})
    harness.step()
    [child_node] = children_of(parent)
    child = harness.live_group(child_node.request_id)
    harness.step({"0": hook_ids.promise})
    second_node = children_of(parent)[1]

    harness.step({"0": hook_ids.eos})
    assert parent.is_finished()
    assert child.first_seq.status == SequenceStatus.FINISHED_ABORTED
    assert child_node.finish_reason == "abort"
    assert second_node.finish_reason == "abort"
    assert not harness.scheduler.running and not harness.scheduler.parked
    assert harness.free_blocks() == free_before
    harness.step()
    assert harness.seq_id_to_seq_group == {}


def test_the_hooks_own_aborts_do_not_come_back_to_them(harness, hook_ids,
                                                       monkeypatch):
    """A parent's finish aborts its live child through the scheduler
    (`abort_tree_groups`), which does not report it back to the hooks: the
    coordinator decided it and is not called again. An abort from outside
    is reported once per group of the tree."""
    hooks = harness.scheduler.hooks
    reported = []
    aborted = hooks.aborted
    monkeypatch.setattr(
        hooks, "aborted", lambda group:
        (reported.append(group.request_id), aborted(group)))
    parent = start(harness)
    harness.step({"0": hook_ids.promise})
    child = harness.live_group(children_of(parent)[0].request_id)
    harness.step({"0": hook_ids.eos})
    assert child.first_seq.status == SequenceStatus.FINISHED_ABORTED
    assert reported == []

    other = start(harness, request_id="1")
    harness.step({"1": hook_ids.promise})
    other_child = children_of(other)[0].request_id
    harness.scheduler.abort_seq_group("1", harness.seq_id_to_seq_group)
    assert sorted(reported) == ["1", other_child]


def test_aborting_the_request_aborts_the_whole_tree(harness, hook_ids):
    free_before = harness.free_blocks()
    parent = start(harness)
    harness.step({"0": hook_ids.promise})
    child_id = children_of(parent)[0].request_id
    harness.step({"0": hook_ids.sync, child_id: hook_ids.promise})
    grandchild_id = harness.live_group(
        child_id
    ).first_seq.promise_tree.tree.nodes[child_id].children[0].request_id
    harness.step({child_id: hook_ids.sync})
    assert set(harness.scheduler.parked) == {"0", child_id}

    harness.scheduler.abort_seq_group("0", harness.seq_id_to_seq_group)
    assert not harness.scheduler.parked and not harness.scheduler.running
    assert parent.first_seq.status == SequenceStatus.FINISHED_ABORTED
    assert harness.free_blocks() == free_before
    assert set(harness.scheduler.get_and_reset_finished_requests_ids()) == {
        "0", child_id, grandchild_id
    }
    assert not harness.scheduler.has_unfinished_seqs()


def test_limits_refuse_promises_and_count_them(tiny_tokenizer_path, hook_ids):
    harness = make_harness(tiny_tokenizer_path,
                           hook_ids,
                           max_children_per_sequence=2,
                           max_children_per_request=3,
                           max_depth=1)
    parent = start(harness)
    for _ in range(3):
        harness.step({"0": hook_ids.promise})
    tree = parent.first_seq.promise_tree.tree
    assert len(tree.root.children) == 2 and tree.num_refused == 1
    # Depth 1: children may not promise.
    child_id = tree.root.children[0].request_id
    harness.step({child_id: hook_ids.promise})
    assert tree.nodes[child_id].children == [] and tree.num_refused == 2
    assert tree.num_spawned == 2


def test_request_wide_limit_spans_the_tree(tiny_tokenizer_path, hook_ids):
    harness = make_harness(tiny_tokenizer_path,
                           hook_ids,
                           max_children_per_request=2)
    parent = start(harness)
    harness.step({"0": hook_ids.promise})
    child_id = children_of(parent)[0].request_id
    harness.step({"0": hook_ids.promise, child_id: hook_ids.promise})
    tree = parent.first_seq.promise_tree.tree
    assert tree.num_spawned == 2 and tree.num_refused == 1


def test_merge_is_cut_to_leave_room_within_max_tokens(harness, hook_ids):
    parent = start(harness, max_tokens=6)
    harness.step({"0": hook_ids.promise})
    child_id = children_of(parent)[0].request_id
    harness.step({"0": hook_ids.sync})
    for _ in range(4):
        harness.step({child_id: word(harness, "cat")})
    harness.step({child_id: hook_ids.eos})
    seq = parent.first_seq
    # "the", <promise>, <sync> + 2 merged: one slot left to sample.
    assert seq.get_output_len() == 5
    assert children_of(parent)[0].text.split() == ["the"] + ["cat"] * 4
    harness.step()
    assert seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED
    assert seq.get_output_len() == 6


def test_role_marker_starts_every_child(tiny_tokenizer_path, hook_ids):
    harness = make_harness(tiny_tokenizer_path,
                           hook_ids,
                           child_role_token_id=hook_ids.child)
    parent = start(harness)
    harness.step({"0": hook_ids.promise})
    child = harness.live_group(children_of(parent)[0].request_id)
    assert child.first_seq.get_output_token_ids()[-2:] == (hook_ids.promise,
                                                           hook_ids.child)
    assert parent.first_seq.get_last_token_id() == hook_ids.promise
    scheduled = {
        s.request_id: (s.num_tokens, s.is_prompt)
        for s in harness.step()
    }
    # The child computes <promise> and its marker in one chunk.
    assert scheduled == {"0": (1, False), child.request_id: (2, True)}


def test_blocked_is_neither_running_nor_finished():
    assert not SequenceStatus.is_finished(SequenceStatus.BLOCKED)
    assert SequenceStatus.get_finished_reason(SequenceStatus.BLOCKED) is None
    finished = [s for s in SequenceStatus if s.name.startswith("FINISHED")]
    assert finished and all(SequenceStatus.is_finished(s) for s in finished)


def test_merge_is_cut_to_leave_room_within_the_model_length(
        tiny_tokenizer_path, hook_ids):
    harness = make_harness(tiny_tokenizer_path, hook_ids,
                           dict(max_model_len=16))
    parent = start(harness)
    harness.step({"0": hook_ids.promise})
    child_id = children_of(parent)[0].request_id
    harness.step({"0": hook_ids.sync})
    while not children_of(parent)[0].is_finished:
        harness.step({child_id: word(harness, "cat")})
    # The child ran into the model length itself, with 8 tokens of its own.
    assert children_of(parent)[0].finish_reason == "length"
    seq = parent.first_seq
    # 5 prompt + "the", <promise>, <sync> + 7 merged: one slot left.
    assert seq.get_len() == 15
    harness.step()
    assert seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED
    assert seq.get_len() == 16


def run_until_done(harness, max_steps=500) -> int:
    for step in range(max_steps):
        harness.step()
        if not harness.scheduler.has_unfinished_seqs():
            return step
    raise AssertionError(f"not done after {max_steps} steps")


def test_parked_parents_are_evicted_rather_than_deadlock(
        tiny_tokenizer_path, hook_ids):
    # 12 blocks of 4 tokens: two parked parents and two growing children
    # cannot all keep their blocks.
    harness = make_harness(tiny_tokenizer_path, hook_ids,
                           dict(num_gpu_blocks=12))
    prompt = "the cat sees the dog the cat sees"
    parents = [
        harness.add(r, prompt, SamplingParams(temperature=0.0, max_tokens=40))
        for r in "ab"
    ]
    harness.step()
    harness.step({"a": hook_ids.promise, "b": hook_ids.promise})
    harness.step({"a": hook_ids.sync, "b": hook_ids.sync})
    assert set(harness.scheduler.parked) == {"a", "b"}
    run_until_done(harness)
    assert harness.free_blocks() == 12
    assert sorted(o.request_id for o in harness.finished_outputs) == ["a", "b"]
    for parent in parents:
        seq = parent.first_seq
        [child] = children_of(parent)
        assert child.finish_reason == "length" and len(child.token_ids) > 20
        assert seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED
        assert parent.first_seq.promise_tree.tree.root.num_merged_tokens > 0


def test_child_the_cache_can_never_hold_finishes_its_parent_wakes(
        tiny_tokenizer_path, hook_ids):
    harness = make_harness(tiny_tokenizer_path, hook_ids,
                           dict(num_gpu_blocks=6))
    parent = start(harness, max_tokens=60)
    harness.step({"0": hook_ids.promise})
    harness.step({"0": hook_ids.sync})
    run_until_done(harness)
    [child] = children_of(parent)
    # Preempted for recompute, then too long for the whole cache: ignored.
    assert child.finish_reason == "length"
    assert parent.first_seq.promise_tree.tree.root.num_merged_tokens > 0
    assert parent.first_seq.is_finished()
    assert harness.free_blocks() == 6
    assert harness.seq_id_to_seq_group == {}
    assert [o.request_id for o in harness.finished_outputs] == ["0"]


def test_child_processed_before_its_parent_finishes_makes_no_output(
        tiny_tokenizer_path, hook_ids):
    # With a role marker a child's first step is a prefill, scheduled ahead
    # of the decodes: the engine processes it before its parent, which then
    # finishes and aborts it in the same step.
    harness = make_harness(tiny_tokenizer_path,
                           hook_ids,
                           child_role_token_id=hook_ids.child)
    parent = start(harness)
    harness.step({"0": hook_ids.promise})
    child_id = children_of(parent)[0].request_id
    scheduled = harness.step({"0": hook_ids.eos})
    assert [s.request_id for s in scheduled] == [child_id, "0"]
    assert children_of(parent)[0].finish_reason == "abort"
    assert harness.output_request_ids == {"0"}
    assert [o.request_id for o in harness.finished_outputs] == ["0"]
    assert harness.seq_id_to_seq_group == {}
    assert harness.free_blocks() == 64


def test_child_stop_string_cuts_its_merged_text(harness, hook_ids):
    parent = harness.add(
        "0", PROMPT,
        SamplingParams(temperature=0.0, max_tokens=32, stop=["dog"]))
    harness.step()
    harness.step({"0": hook_ids.promise})
    child_id = children_of(parent)[0].request_id
    harness.step({"0": hook_ids.sync, child_id: word(harness, "cat")})
    harness.step({child_id: word(harness, "dog")})
    [child] = children_of(parent)
    assert child.finish_reason == "stop"
    # The child's text stops before its stop string, as its output would.
    assert child.text.split() == ["cat"]
    seq = parent.first_seq
    assert seq.get_output_token_ids()[-2:] == (hook_ids.sync,
                                               word(harness, "cat"))
    assert "dog" not in seq.output_text


def test_aborting_a_childs_own_id_aborts_its_whole_tree(harness, hook_ids):
    parent = start(harness)
    harness.step({"0": hook_ids.promise})
    child_id = children_of(parent)[0].request_id
    # As the engine does when a child's input fails to process.
    harness.scheduler.abort_seq_group(child_id, harness.seq_id_to_seq_group)
    assert parent.first_seq.status == SequenceStatus.FINISHED_ABORTED
    assert not harness.scheduler.running
    assert harness.free_blocks() == 64


def test_children_past_max_num_seqs_wait_their_turn(tiny_tokenizer_path,
                                                    hook_ids):
    harness = make_harness(tiny_tokenizer_path, hook_ids, dict(max_num_seqs=2))
    parent = start(harness)
    harness.step({"0": hook_ids.promise})
    harness.step({"0": hook_ids.promise})
    first, second = (harness.live_group(c.request_id)
                     for c in children_of(parent))
    assert first in harness.scheduler.running
    # The running queue is full: the second child waits, with no blocks.
    assert second in harness.scheduler.waiting
    assert second.first_seq.status == SequenceStatus.WAITING
    harness.step({"0": hook_ids.sync, first.request_id: hook_ids.eos})
    run_until_done(harness)
    assert [c.finish_reason for c in children_of(parent)] == ["stop", "length"]
    assert harness.free_blocks() == 64


def test_children_get_seeds_of_their_own(harness, hook_ids):
    parent = harness.add(
        "0", PROMPT, SamplingParams(temperature=1.0, seed=7, max_tokens=32))
    harness.step()
    harness.step({"0": hook_ids.promise})
    first_steps = [harness.step({"0": hook_ids.promise})]
    first_steps.append(harness.step())
    seeds = [
        harness.live_group(child.request_id).sampling_params.seed
        for child in children_of(parent)
    ]
    # Neither the parent's seed (its generator would replay the parent's
    # stream) nor each other's; the parent keeps its own.
    assert parent.sampling_params.seed == 7
    assert 7 not in seeds and len(set(seeds)) == 2
    # Seeded children start with a prefill, which creates their generator.
    for child, scheduled in zip(children_of(parent), first_steps):
        assert [
            s.is_prompt for s in scheduled if s.request_id == child.request_id
        ] == [True]


def test_child_min_tokens_count_from_its_fork_point(harness, hook_ids):
    parent = harness.add(
        "0", PROMPT,
        SamplingParams(temperature=0.0, min_tokens=4, max_tokens=32))
    for _ in range(5):
        harness.step()
    harness.step({"0": hook_ids.promise})
    child_id = children_of(parent)[0].request_id
    child = harness.live_group(child_id)
    # The child's context already holds 6 output tokens; EOS before four
    # tokens of its own does not end it.
    for _ in range(3):
        harness.step({child_id: hook_ids.eos})
        assert not child.is_finished()
    harness.step({child_id: hook_ids.eos})
    assert child.first_seq.status == SequenceStatus.FINISHED_STOPPED


def test_merged_text_never_holds_hook_tokens(tiny_tokenizer_path, hook_ids):
    # Children may not promise (max_depth=1), so a child's <promise> stays
    # an ordinary token, as does a <sync> without children; with special
    # tokens not skipped, both are in the child's detokenized text.
    harness = make_harness(tiny_tokenizer_path, hook_ids, max_depth=1)
    parent = harness.add(
        "0", PROMPT,
        SamplingParams(temperature=0.0,
                       max_tokens=32,
                       skip_special_tokens=False))
    harness.step()
    harness.step({"0": hook_ids.promise})
    child_id = children_of(parent)[0].request_id
    cat = word(harness, "cat")
    harness.step({"0": hook_ids.sync, child_id: hook_ids.promise})
    harness.step({child_id: hook_ids.sync})
    child_seq = harness.live_group(child_id).first_seq
    assert "<promise>" in child_seq.output_text
    assert "<sync>" in child_seq.output_text
    harness.step({child_id: cat})
    harness.step({child_id: hook_ids.eos})

    [child_node] = children_of(parent)
    assert "cat" in child_node.text.split()
    assert "<promise>" not in child_node.text
    assert "<sync>" not in child_node.text
