# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End-to-end on V1: the V0 suite's named programs on the hook scheduler.

Each program is scripted through the V1 logits processor and compared token
for token with the hook-free reference built on a stock V1 engine; after
every test the engine core must be clean: every KV block back in the pool,
no request, no tree left.
"""

from sequence_hooks import training_records
from sequence_hooks.actions import derive_seed
from sequence_hooks_testkit import conformance
from sequence_hooks_testkit.programs import NONE, programs
from sequence_hooks_testkit.v1_engines import (V1, assert_engine_clean,
                                               computed_tokens, scheduler_of,
                                               scripted_params)


class TestConformance(conformance.FlavourConformance):
    """The checks every flavour passes, on V1."""
    flavour = V1


def test_scheduled_tokens_for_child_start_and_parent_resume(
        hooked_llm, hook_ids):
    plans = programs(hook_ids)["sync before the child finishes"]
    with computed_tokens(scheduler_of(hooked_llm)) as log:
        [output] = conformance.run_hooked(V1, hooked_llm, hook_ids,
                                          ["the cat sees"], [plans])
    tree = V1.promise_tree(output)
    [child] = tree.children
    child_chunks = [n for rid, n in log if rid == child.request_id]
    root_chunks = [n for rid, n in log if rid == tree.request_id]
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
    engine.add_request("long", {"prompt_token_ids": prompt},
                       scripted_params(plans, hook_ids))
    with computed_tokens(scheduler) as log:
        engine.step()  # the prompt; samples <promise>
        engine.step()  # <promise> for the parent, and the child's start
        [tree] = {
            id(tree): tree
            for tree in map(scheduler.hooks.coordinator.tree_of,
                            scheduler.requests) if tree is not None
        }.values()
        root_id = tree.root.request_id
        [child] = tree.root.children
        child_id = child.request_id
        [parent_blocks] = manager.get_blocks(root_id).blocks
        [child_blocks] = manager.get_blocks(child_id).blocks
        assert child_blocks[0] is parent_blocks[0]
        assert parent_blocks[0].ref_cnt == 2
        assert child_blocks[1] is not parent_blocks[1]
        assert [n for rid, n in log if rid == child_id] == [2]
        while engine.has_unfinished_requests():
            engine.step()
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
    # The scheduler's admission limit (the model runner's rows,
    # `max_num_running_reqs`, are another).
    name = "max_num_active_reqs"
    limit = getattr(scheduler, name)
    setattr(scheduler, name, 2)
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
        setattr(scheduler, name, limit)
    assert sorted(finished) == ["71", "72"]
    assert_engine_clean(hooked_llm)


def test_a_resumed_parent_keeps_its_budget(hooked_llm, hook_ids):
    """`max_tokens` counts the whole output, merged tokens included, across
    a resume (the parent's output so far is prompt inside the engine core
    after it); upstream's `_update_request_as_session` sets the chunk's
    budget (vLLM 0.30's kept the first chunk's)."""
    plans = {
        (): [hook_ids.promise, hook_ids.sync] + [NONE] * 40,
        (0, ): [NONE] * 3
    }
    [output] = conformance.run_hooked(V1,
                                      hooked_llm,
                                      hook_ids, ["the cat sees"], [plans],
                                      max_tokens=12)
    [completion] = output.outputs
    tree = V1.promise_tree(output)
    [(start, merged)] = tree.merged_spans
    assert tree.children[0].finish_reason == "stop"
    # `<promise>`, `<sync>`, the merge, then the parent's own tokens up to
    # the budget.
    assert start == 2 and 2 + merged < 12
    assert len(completion.token_ids) == 12, completion.token_ids
    assert tuple(completion.token_ids) == tree.token_ids
    assert completion.finish_reason == tree.finish_reason == "length"
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


def test_training_records_of_a_tree_from_the_engine_core(hooked_llm, hook_ids):
    plans = programs(hook_ids)["sync before the child finishes"]
    params = scripted_params(plans, hook_ids)
    params.logprobs = 1
    [output] = hooked_llm.generate(["the cat sees"], params, use_tqdm=False)
    tree = V1.promise_tree(output)
    root, child = training_records(output.prompt_token_ids, tree,
                                   hook_ids.child)
    assert child.context_token_ids == (tuple(output.prompt_token_ids) +
                                       tree.token_ids[:1] + (hook_ids.child, ))
    assert child.token_ids == tree.children[0].token_ids
    assert all(child.sampled_mask) and None not in child.logprobs
    assert [lp is None for lp in root.logprobs
            ] == [not sampled for sampled in root.sampled_mask]
    assert_engine_clean(hooked_llm)


def test_a_streamed_requests_tree_comes_with_its_last_delta(
        hooked_llm, hook_ids):
    params = scripted_params(programs(hook_ids)["one promise"], hook_ids)
    deltas = streamed(hooked_llm, "deltas", params)
    assert deltas[-1].finished
    assert_last_delta_brings_the_tree(deltas)
    assert_engine_clean(hooked_llm)


def streamed(llm, request_id: str, params) -> list:
    """Every delta output of one streamed request, in order."""
    from vllm.sampling_params import RequestOutputKind
    params.output_kind = RequestOutputKind.DELTA
    engine = llm.llm_engine
    engine.add_request(request_id, {"prompt_token_ids": [7, 8, 9]}, params)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    return deltas


def assert_last_delta_brings_the_tree(deltas) -> None:
    """Only the last delta has a tree: the streamed tokens, one child whose
    text was streamed merged."""
    *earlier, last = deltas
    assert all(V1.promise_tree(o) is None for o in earlier)
    tree = V1.promise_tree(last)
    assert list(tree.token_ids) == [
        token for o in deltas for token in o.outputs[0].token_ids
    ]
    [child] = tree.children
    assert child.text.strip() in "".join(o.outputs[0].text for o in deltas)


def seeded_plain(llm, plans, hook_ids, context, max_tokens, seed, role):
    """The tokens a hook-free request with ``seed`` samples over
    ``context``, scripted as ``role`` from its first step."""
    params = scripted_params(plans, hook_ids, max_tokens, role=role)
    params.temperature, params.seed = 1.0, seed
    [output] = llm.generate({"prompt_token_ids": context},
                            params,
                            use_tqdm=False)
    return list(output.outputs[0].token_ids)


def test_seeded_samples_trees_are_hook_free_requests(hooked_llm, hook_ids):
    """Each seeded sample's tree is what hook-free requests sample: the
    root up to its `<sync>` with the sample's seed (the frontend gives
    sample i the seed + i), each child over its context with the seed
    derived from that. After the merge the root's generator goes on,
    which no fresh request replays."""
    plans = programs(hook_ids)["several promises"]
    params = scripted_params(plans, hook_ids)
    params.n, params.temperature, params.seed = 3, 1.0, 3
    [output] = hooked_llm.generate(["the cat sees"], params, use_tqdm=False)
    prompt = output.prompt_token_ids
    num_before_sync = plans[()].index(hook_ids.sync) + 1
    for completion in output.outputs:
        tree = V1.sample_tree(output, completion)
        seed = params.seed + completion.index
        assert list(tree.token_ids[:num_before_sync]) == seeded_plain(
            hooked_llm, plans, hook_ids, prompt, num_before_sync, seed, ())
        for k, child in enumerate(tree.children):
            context = (prompt + list(tree.token_ids[:child.fork_position]) +
                       [hook_ids.child])
            assert list(child.token_ids) == seeded_plain(
                hooked_llm, plans, hook_ids, context, len(child.token_ids),
                derive_seed(seed, f"child-{k}"), (k, ))
    assert_engine_clean(hooked_llm)


def test_each_streamed_sample_brings_its_tree(hooked_llm, hook_ids):
    params = scripted_params(programs(hook_ids)["one promise"], hook_ids)
    params.n, params.temperature, params.seed = 2, 1.0, 5
    deltas = streamed(hooked_llm, "sampled-deltas", params)
    for index in (0, 1):
        assert_last_delta_brings_the_tree(
            [o for o in deltas if o.outputs[0].index == index])
    assert_engine_clean(hooked_llm)


def test_aborting_a_sampled_request_forgets_its_samples(hooked_llm, hook_ids):
    engine = hooked_llm.llm_engine
    scheduler = scheduler_of(hooked_llm)
    plans = {(): [hook_ids.promise, hook_ids.sync], (0, ): [NONE] * 40}
    params = scripted_params(plans, hook_ids)
    params.n, params.temperature, params.seed = 2, 1.0, 5
    engine.add_request("abort-samples", {"prompt_token_ids": [7, 8, 9]},
                       params)
    for _ in range(5):
        engine.step()
    assert len(scheduler.hooks.members.sample_trees) == 1
    engine.abort_request(["abort-samples"])
    engine.step()
    assert_engine_clean(hooked_llm)


def generate_one(llm, plans, hook_ids, stop_word=None, **fields):
    """The output of one scripted request, stopped at ``stop_word`` (a
    word after a space) if given, with `SamplingParams` ``fields``."""
    params = scripted_params(plans, hook_ids)
    if stop_word is not None:
        params.stop = [" " + stop_word]
    for name, value in fields.items():
        setattr(params, name, value)
    [output] = llm.generate(["the cat sees"], params, use_tqdm=False)
    return output


def finished_children(tree):
    return [(child.token_ids, child.text, child.finish_reason)
            for child in tree.children]


def test_a_request_ended_by_a_stop_string_reports_its_tree(
        hooked_llm, hook_ids):
    """Stopped after its merge: the tree is the whole run's up to the
    stop, the root finished with "stop" where its output ends."""
    plans = programs(hook_ids)["one promise"]
    full = generate_one(hooked_llm, plans, hook_ids)
    full_tree = V1.promise_tree(full)
    word = full.outputs[0].text.split()[-2]
    stopped = generate_one(hooked_llm, plans, hook_ids, word)
    completion = stopped.outputs[0]
    assert completion.stop_reason == " " + word
    assert full.outputs[0].text.startswith(completion.text + " " + word)
    tree = V1.promise_tree(stopped)
    assert tree.finish_reason == "stop"
    assert tree.text == completion.text
    assert tree.token_ids == tuple(completion.token_ids)
    assert tree.token_ids == full_tree.token_ids[:len(tree.token_ids)]
    assert len(tree.token_ids) < len(full_tree.token_ids)
    assert tree.merged_spans == full_tree.merged_spans
    assert finished_children(tree) == finished_children(full_tree)
    assert_engine_clean(hooked_llm)


def test_a_stop_string_inside_a_merge_ends_the_tokens_there(
        hooked_llm, hook_ids):
    """A stop string completed by the first merged token (it spans the
    parent's text and the child's, so the child never sees it): the
    merged tokens after it are dropped from the output and the tree, as
    vLLM 0.32's frontend drops them and 0.31's would not."""
    plans = programs(hook_ids)["one promise"]
    full = generate_one(hooked_llm, plans, hook_ids)
    [(start, count)] = V1.promise_tree(full).merged_spans
    assert count > 1
    ids = list(full.outputs[0].token_ids)
    tokenizer = hooked_llm.get_tokenizer()
    word = (
        tokenizer.decode(ids[:start], skip_special_tokens=True).split()[-1] +
        " " + tokenizer.decode([ids[start]]).strip())
    stopped = generate_one(hooked_llm, plans, hook_ids, word)
    completion = stopped.outputs[0]
    assert completion.stop_reason == " " + word
    assert list(completion.token_ids) == ids[:start + 1]
    tree = V1.promise_tree(stopped)
    assert tree.token_ids == tuple(completion.token_ids)
    assert tree.merged_spans == ((start, 1), )
    assert tree.text == completion.text
    assert_engine_clean(hooked_llm)


def test_a_stop_string_aborts_the_children_still_running(hooked_llm, hook_ids):
    """As on V0: the root stops, its running child is aborted."""
    plans = {
        (): [NONE, hook_ids.promise, NONE, NONE, NONE, NONE, hook_ids.sync],
        (0, ): [NONE] * 12,
    }
    full = generate_one(hooked_llm, plans, hook_ids)
    # The root's second word after its `<promise>`: its child has begun.
    word = full.outputs[0].text.split()[2]
    stopped = generate_one(hooked_llm, plans, hook_ids, word)
    tree = V1.promise_tree(stopped)
    assert tree.finish_reason == "stop"
    assert tree.token_ids == tuple(stopped.outputs[0].token_ids)
    assert tree.token_ids[1] == hook_ids.promise and len(tree.token_ids) == 4
    assert tree.num_merged_tokens == 0
    # What V0 reports of a child its stopped root aborted.
    [child] = tree.children
    assert child.finish_reason == "abort"
    assert child.token_ids == () and child.text == ""
    assert_engine_clean(hooked_llm)


def test_a_streamed_request_ended_by_a_stop_string_brings_its_tree(
        hooked_llm, hook_ids):
    from vllm.sampling_params import RequestOutputKind
    engine = hooked_llm.llm_engine
    plans = programs(hook_ids)["one promise"]
    full_tree = V1.promise_tree(generate_one(hooked_llm, plans, hook_ids))
    word = full_tree.text.split()[-2]
    params = scripted_params(plans, hook_ids)
    params.stop, params.output_kind = [" " + word], RequestOutputKind.DELTA
    engine.add_request("stopped-deltas", "the cat sees", params)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    *earlier, last = deltas
    assert last.finished and last.outputs[0].stop_reason == " " + word
    assert all(V1.promise_tree(o) is None for o in earlier)
    tree = V1.promise_tree(last)
    assert tree.finish_reason == "stop"
    assert list(tree.token_ids) == [
        token for o in deltas for token in o.outputs[0].token_ids
    ]
    assert tree.text == "".join(o.outputs[0].text for o in deltas)
    [child] = tree.children
    assert child.finish_reason == "stop"
    assert_engine_clean(hooked_llm)


def test_each_sample_ended_by_a_stop_string_reports_its_tree(
        hooked_llm, hook_ids):
    """n = 2 seeded: a stop string of one sample's text stops that sample
    only; each sample's tree is there, the other's as without it."""
    plans = programs(hook_ids)["one promise"]
    fields = dict(n=2, temperature=1.0, seed=3)
    full = generate_one(hooked_llm, plans, hook_ids, **fields)
    full_samples = {
        completion.index: completion
        for completion in full.outputs
    }
    first, second = full_samples[0], full_samples[1]
    word = next(word for word in reversed(first.text.split()[:-1])
                if word not in second.text.split())
    stopped = generate_one(hooked_llm, plans, hook_ids, word, **fields)
    for completion in stopped.outputs:
        tree = V1.promise_tree(stopped, completion)
        full_tree = V1.promise_tree(full, full_samples[completion.index])
        assert tree.finish_reason == "stop"
        assert tree.text == completion.text
        assert tree.token_ids == tuple(completion.token_ids)
        assert finished_children(tree) == finished_children(full_tree)
        if completion.index == first.index:
            assert completion.stop_reason == " " + word
            assert len(tree.token_ids) < len(full_tree.token_ids)
        else:
            assert tree.token_ids == full_tree.token_ids
    assert_engine_clean(hooked_llm)
