# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End-to-end on V1: the V0 suite's named programs on the hook scheduler.

Each program is scripted through the V1 logits processor and compared token
for token with the hook-free reference built on a stock V1 engine; after
every test the engine core must be clean: every KV block back in the pool,
no request, no tree left.
"""

import pytest

from sequence_hooks import training_records
from sequence_hooks_testkit import conformance
from sequence_hooks_testkit.programs import NONE, programs
from sequence_hooks_testkit.v1_engines import (V1, assert_engine_clean,
                                               scheduler_of, scripted_params)


@pytest.mark.parametrize("name", conformance.PROGRAM_NAMES)
def test_program_matches_the_hook_free_reference(hooked_llm, plain_llm,
                                                 hook_ids, name):
    conformance.check_program(V1, hooked_llm, plain_llm, hook_ids, name)


def test_many_requests_at_once(hooked_llm, plain_llm, hook_ids):
    conformance.check_many_requests(V1, hooked_llm, plain_llm, hook_ids)


@pytest.mark.parametrize("tokens_after_promise", [0, 1])
def test_parent_eos_aborts_live_children(hooked_llm, plain_llm, hook_ids,
                                         tokens_after_promise):
    conformance.check_parent_eos_aborts_live_children(V1, hooked_llm,
                                                      plain_llm, hook_ids,
                                                      tokens_after_promise)


def test_promise_storm_stays_within_the_limits(hooked_llm, hook_ids):
    refused = conformance.hook_metric(hooked_llm, "promises_refused_total")
    conformance.check_promise_storm(V1, hooked_llm, hook_ids)
    assert conformance.hook_metric(hooked_llm,
                                   "promises_refused_total") > refused


def test_scheduled_tokens_for_child_start_and_parent_resume(
        hooked_llm, hook_ids):
    scheduler = scheduler_of(hooked_llm)
    scheduler.computed_log = []
    try:
        plans = programs(hook_ids)["sync before the child finishes"]
        [output] = conformance.run_hooked(V1, hooked_llm, hook_ids,
                                          ["the cat sees"], [plans])
    finally:
        log, scheduler.computed_log = scheduler.computed_log, None
    tree = V1.promise_tree(output)
    [child] = tree.children
    child_chunks = [n for _, rid, n in log if rid == child.request_id]
    root_chunks = [n for _, rid, n in log if rid == tree.request_id]
    print(f"child chunks {child_chunks}, root chunks {root_chunks}")
    # The child computes only <promise> and its role marker, then decodes.
    assert child_chunks[0] == 2
    assert set(child_chunks[1:]) == {1}
    # The parent: its prompt, one decode (<promise>), then, after waiting,
    # exactly <sync> plus the merged tokens, then decodes.
    merged = tree.num_merged_tokens
    assert merged > 0
    assert root_chunks[:3] == [len(output.prompt_token_ids), 1, 1 + merged]
    assert set(root_chunks[3:]) == {1}
    assert_engine_clean(hooked_llm)


def test_child_shares_full_blocks_and_copies_the_partial_one(
        hooked_llm, hook_ids):
    """A context past one KV block: the full block is shared by reference,
    the partly filled one is copied, and the child still computes 2."""
    engine = hooked_llm.llm_engine
    scheduler = scheduler_of(hooked_llm)
    manager = scheduler.kv_cache_manager
    prompt = [7 + i % 50 for i in range(scheduler.block_size + 5)]
    plans = {(): [hook_ids.promise, hook_ids.sync, NONE], (0, ): [NONE] * 6}
    scheduler.computed_log = []
    engine.add_request("long", {"prompt_token_ids": prompt},
                       scripted_params(plans, hook_ids))
    try:
        engine.step()  # the prompt; samples <promise>
        engine.step()  # <promise> for the parent, and the child's start
        [tree] = {id(tree): tree for tree in scheduler.trees.values()}.values()
        root_id = tree.root.request_id
        [child] = tree.root.children
        child_id = child.request_id
        [parent_blocks] = manager.get_blocks(root_id).blocks
        [child_blocks] = manager.get_blocks(child_id).blocks
        assert child_blocks[0] is parent_blocks[0]
        assert parent_blocks[0].ref_cnt == 2
        assert child_blocks[1] is not parent_blocks[1]
        assert [n for _, rid, n in scheduler.computed_log
                if rid == child_id] == [2]
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        scheduler.computed_log = None
    assert_engine_clean(hooked_llm)


def test_child_promising_as_its_root_ends_spawns_nothing(hooked_llm, hook_ids):
    # The root samples its EOS in the step its child samples <promise>:
    # the root's output comes first and aborts the child, whose promise
    # must then be ignored (found by the reference runs).
    plans = {
        (): [hook_ids.promise, NONE],
        (0, ): [NONE, hook_ids.promise] + [NONE] * 10,
        (0, 0): [NONE] * 10,
    }
    [output] = conformance.run_hooked(V1, hooked_llm, hook_ids,
                                      ["the cat sees"], [plans])
    [child] = V1.promise_tree(output).children
    assert child.finish_reason == "abort"
    assert child.children == ()
    assert_engine_clean(hooked_llm)


def test_parked_parents_do_not_block_their_children(hooked_llm, hook_ids):
    # As many parents as max_num_seqs, all parked at once: their children
    # must still be admitted.
    engine = hooked_llm.llm_engine
    scheduler = scheduler_of(hooked_llm)
    plans = {(): [hook_ids.promise, hook_ids.sync, NONE], (0, ): [NONE] * 4}
    limit = scheduler.max_num_active_reqs
    scheduler.max_num_active_reqs = 2
    try:
        for request_id in ("71", "72"):
            engine.add_request(request_id, {"prompt_token_ids": [7, 8, 9]},
                               scripted_params(plans, hook_ids))
        finished = []
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            finished += [o.request_id for o in engine.step() if o.finished]
    finally:
        scheduler.max_num_active_reqs = limit
    assert sorted(finished) == ["71", "72"]
    assert_engine_clean(hooked_llm)


def test_aborting_a_request_aborts_its_tree(hooked_llm, hook_ids):
    engine = hooked_llm.llm_engine
    scheduler = scheduler_of(hooked_llm)
    plans = {(): [hook_ids.promise, hook_ids.sync], (0, ): [NONE] * 40}
    engine.add_request("abort-me", {"prompt_token_ids": [7, 8, 9]},
                       scripted_params(plans, hook_ids))
    for _ in range(5):
        engine.step()
    # The parent is parked, holding its blocks; its child runs.
    assert scheduler.num_waiting_for_streaming_input == 1
    assert len(scheduler.requests) == 2
    engine.abort_request(["abort-me"])
    engine.step()
    assert_engine_clean(hooked_llm)


def seeded_params(plans, hook_ids, **fixed):
    params = scripted_params(plans, hook_ids, max_tokens=40, **fixed)
    params.temperature, params.seed = 1.0, 1234
    return params


def test_seeded_sampling_gives_each_child_its_own_stream(hooked_llm, hook_ids):
    plans = {
        (): [NONE, hook_ids.promise, hook_ids.promise, hook_ids.sync, NONE],
        (0, ): [NONE] * 8,
        (1, ): [NONE] * 8,
    }

    def run():
        [output] = hooked_llm.generate(["the cat sees"],
                                       seeded_params(plans, hook_ids),
                                       use_tqdm=False)
        return output

    first, again = run(), run()
    assert first.outputs[0].token_ids == again.outputs[0].token_ids
    texts = [child.text for child in V1.promise_tree(first).children]
    assert texts == [child.text for child in V1.promise_tree(again).children]
    # Same context, same plan, different derived seeds: different samples.
    assert texts[0] != texts[1]
    assert_engine_clean(hooked_llm)


def test_a_child_does_not_replay_its_parents_seed(hooked_llm, hook_ids):
    # A child's generator starts at its first step. Seeded with the
    # parent's seed, it would sample exactly what a fresh request with
    # that seed samples over the same context.
    plans = {(): [NONE, hook_ids.promise, hook_ids.sync], (0, ): [NONE] * 12}
    [output] = hooked_llm.generate(["the cat sees"],
                                   seeded_params(plans, hook_ids),
                                   use_tqdm=False)
    [child] = V1.promise_tree(output).children
    context = (output.prompt_token_ids +
               list(output.outputs[0].token_ids[:2]) + [hook_ids.child])
    fresh_params = seeded_params(plans, hook_ids, role=(0, ))
    fresh_params.max_tokens = len(child.token_ids)
    [fresh] = hooked_llm.generate({"prompt_token_ids": context},
                                  fresh_params,
                                  use_tqdm=False)
    assert len(fresh.outputs[0].token_ids) == len(child.token_ids)
    assert list(fresh.outputs[0].token_ids) != list(child.token_ids)
    assert_engine_clean(hooked_llm)


def test_logprobs_of_a_tree_with_merges(hooked_llm, hook_ids):
    plans = programs(hook_ids)["sync before the child finishes"]
    params = scripted_params(plans, hook_ids)
    params.logprobs = 2
    [output] = hooked_llm.generate(["the cat sees"], params, use_tqdm=False)
    completion = output.outputs[0]
    tree = V1.promise_tree(output)
    [child] = tree.children
    [(start, count)] = tree.merged_spans
    assert count == tree.num_merged_tokens > 0
    # The request's logprobs: one entry per token, merged ones 0.0 (V0's).
    assert len(completion.logprobs) == len(completion.token_ids)
    for i, token in enumerate(completion.token_ids):
        merged = start <= i < start + count
        assert (completion.logprobs[i][token].logprob == 0.0) == merged
    # The tree: the root's entries are the request's, None where merged.
    assert tree.logprobs[start:start + count] == (None, ) * count
    assert tree.logprobs[:start] == tuple(completion.logprobs[:start])
    # The child's: what a fresh request over its context gets, greedy.
    context = (output.prompt_token_ids + list(completion.token_ids[:1]) +
               [hook_ids.child])
    fresh_params = scripted_params(plans,
                                   hook_ids,
                                   len(child.token_ids),
                                   role=(0, ))
    fresh_params.logprobs = 2
    [fresh] = hooked_llm.generate({"prompt_token_ids": context},
                                  fresh_params,
                                  use_tqdm=False)
    assert list(fresh.outputs[0].token_ids) == list(child.token_ids)
    for token, mine, theirs in zip(child.token_ids, child.logprobs,
                                   fresh.outputs[0].logprobs):
        assert sorted(mine) == sorted(theirs)
        assert mine[token].logprob == pytest.approx(theirs[token].logprob,
                                                    abs=1e-4)
    assert child.cumulative_logprob == pytest.approx(
        fresh.outputs[0].cumulative_logprob, abs=1e-3)
    # Training records read the same tree as on V0.
    root_record, child_record = training_records(output.prompt_token_ids, tree,
                                                 hook_ids.child)
    assert child_record.context_token_ids == tuple(context)
    assert root_record.logprobs[start:start + count] == (None, ) * count
    assert_engine_clean(hooked_llm)


def test_parallel_samples_each_run_their_own_tree(hooked_llm, hook_ids):
    # V1's frontend fans `n` out into one engine request per sample, so
    # each sample is a root of its own tree; the aggregated output keeps
    # only the last sample's `kv_transfer_params`, so, as on V0, the
    # request reports no tree.
    plans = programs(hook_ids)["several promises"]
    params = scripted_params(plans, hook_ids)
    params.n, params.temperature, params.seed = 2, 1.0, 3
    [output] = hooked_llm.generate(["the cat sees"], params, use_tqdm=False)
    assert len(output.outputs) == 2
    for completion in output.outputs:
        assert completion.finish_reason == "stop"
        # The parent sampled its plan and EOS; the rest was merged.
        assert len(completion.token_ids) > len(plans[()]) + 1
    assert V1.promise_tree(output) is None
    assert_engine_clean(hooked_llm)


def test_metrics_count_what_the_hooks_did(hooked_llm, hook_ids):
    conformance.check_metrics(V1, hooked_llm, hook_ids)
