# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Promise trees on a V1 engine whose KV pool cannot hold them all.

Random trees (the fuzz's policy) over six requests on a tight pool of 32
token blocks. On 11 usable blocks running members get preempted and
recomputed by upstream's scheduler. On 7 the parked parents alone hold
the pool and their children cannot be admitted: parked parents are
evicted and recompute their context at resume. Every tree must finish
with the outputs of the same requests on the session's roomy engine (the
random policy draws each token from a hash of the context, so the
engines' logits do not matter) and leave every block free. Seeded parents
evicted there sample on after their resume as they do without pressure.
"""

import collections

import pytest
from vllm_sequence_hooks import promise_tree

from sequence_hooks_testkit.conformance import assert_fuzz_outcome, hook_odds
from sequence_hooks_testkit.programs import NONE
from sequence_hooks_testkit.v1_engines import (assert_engine_clean,
                                               computed_tokens,
                                               preempted_requests,
                                               run_to_the_end, scheduler_of,
                                               scripted_params, v1_llm)
from sequence_hooks_testkit.v1_scripted_logits import POLICY_KEY
from vllm import SamplingParams
from vllm.v1.engine import EngineCoreEventType

BLOCK_SIZE = 32
MAX_STEPS = 3000
ROOTS = [str(i) for i in range(6)]


def run_trees(llm, hook_ids, monkeypatch) -> dict[str, tuple]:
    """Runs the six random trees to the end on ``llm``.

    Returns:
        Each root's final (token ids, text).
    """
    engine = llm.llm_engine
    case = {"promise_p": 0.2, "sync_p": 0.1, "eos_p": 0.02}
    policy = {
        "seed": 1,
        "words": list(range(7, 40)),
        "hooks": hook_odds(case, hook_ids)
    }
    for i, request_id in enumerate(ROOTS):
        engine.add_request(
            request_id, {"prompt_token_ids": [7 + i, 8, 9, 10]},
            SamplingParams(temperature=0.0,
                           max_tokens=60,
                           extra_args={POLICY_KEY: policy}))
    results = {}
    step = engine.step

    def recorded_step():
        outputs = step()
        results.update({
            out.request_id:
            (list(out.outputs[0].token_ids), out.outputs[0].text)
            for out in outputs if out.finished
        })
        return outputs

    with monkeypatch.context() as patch:
        patch.setattr(engine, "step", recorded_step)
        finished, output_ids = run_to_the_end(engine, MAX_STEPS)
    assert_fuzz_outcome(ROOTS, set(), finished, output_ids)
    assert_engine_clean(llm)
    return results


@pytest.fixture(scope="module")
def roomy_results(hooked_llm, hook_ids):
    with pytest.MonkeyPatch.context() as patch:
        return run_trees(hooked_llm, hook_ids, patch)


def llm_with_blocks(tiny_model_path, hook_ids, num_blocks: int):
    """A hooked engine whose KV pool has ``num_blocks`` blocks of
    `BLOCK_SIZE` tokens, one of them the pool's null block."""
    return v1_llm(tiny_model_path,
                  hook_ids,
                  block_size=BLOCK_SIZE,
                  num_gpu_blocks_override=num_blocks,
                  max_model_len=128)


@pytest.fixture(scope="module")
def tight_llm(tiny_model_path, hook_ids):
    # 11 usable blocks.
    return llm_with_blocks(tiny_model_path, hook_ids, 12)


@pytest.fixture(scope="module")
def tighter_llm(tiny_model_path, hook_ids):
    # 7 usable blocks: the parked parents alone fill them.
    return llm_with_blocks(tiny_model_path, hook_ids, 8)


def test_trees_finish_under_preemption_and_free_every_block(
        tight_llm, hook_ids, roomy_results, monkeypatch):
    preempted = preempted_requests(scheduler_of(tight_llm), monkeypatch)
    assert run_trees(tight_llm, hook_ids, monkeypatch) == roomy_results
    assert preempted, "the pool was not tight: nothing was preempted"


def test_parked_parents_are_evicted_and_recompute_at_resume(
        tighter_llm, hook_ids, roomy_results, monkeypatch):
    scheduler = scheduler_of(tighter_llm)
    # (request id, tokens of its next chunk, length of `log`) of each
    # resume of an evicted parent.
    resumes = []
    resume = scheduler.hooks.carrier.resume

    def recorded_resume(action, *args, **kwargs):
        member_id = action.member_id
        request = scheduler.requests[member_id]
        evicted = scheduler.hooks.members.get(member_id).evicted
        num_computed = request.num_computed_tokens
        resume(action, *args, **kwargs)
        if evicted:
            assert request.num_computed_tokens == 0
            resumes.append((request.request_id,
                            request.num_tokens - num_computed, len(log)))

    monkeypatch.setattr(scheduler.hooks.carrier, "resume", recorded_resume)
    with computed_tokens(scheduler) as log:
        assert run_trees(tighter_llm, hook_ids, monkeypatch) == roomy_results
    assert resumes, "no parked parent was evicted"
    # Each evicted parent's first step after its resume computes more than
    # its next chunk (`<sync>` and the merged tokens): its context too,
    # less what the prefix cache gave back.
    recomputed = [
        next(n
             for request_id, n in log[start:] if request_id == resumed) - chunk
        for resumed, chunk, start in resumes
    ]
    assert any(n > 0 for n in recomputed), recomputed


def wide_plans(hook_ids, num_children: int, child_tokens: int) -> dict:
    """A word, ``num_children`` promises, a sync, four words; each child
    writes ``child_tokens``."""
    plans = {
        (): [NONE] + [hook_ids.promise] * num_children + [hook_ids.sync] +
        [NONE] * 4
    }
    plans.update({(i, ): [NONE] * child_tokens for i in range(num_children)})
    return plans


def test_childrens_preemptions_go_out_with_their_roots(tight_llm, hook_ids,
                                                       monkeypatch):
    """`vllm:num_preemptions` counts the `PREEMPTED` events of the outputs
    that reach the frontend, and a child's outputs never leave the engine
    core, so its events go out with its root's. One tree whose six
    children of 90 tokens (three blocks each) cannot all fit 11 usable
    blocks preempts some of them whatever the timing. Read where the
    engine core hands its outputs over; the server's counter is asserted
    by the reliability suite."""
    scheduler = scheduler_of(tight_llm)
    # As on a server: the scheduler records events only with statistics
    # on. Its step statistics stay off (this engine keeps none to make
    # them from); the events are what the frontend counts.
    monkeypatch.setattr(scheduler, "log_stats", True)
    monkeypatch.setattr(scheduler, "make_stats", lambda *args, **kwargs: None)
    preempted = preempted_requests(scheduler, monkeypatch)
    sent = collections.Counter()
    update = scheduler.update_from_output

    def recorded_update(*args, **kwargs):
        outputs = update(*args, **kwargs)
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                sent[out.request_id] += sum(
                    event.type == EngineCoreEventType.PREEMPTED
                    for event in out.events or ())
        return outputs

    monkeypatch.setattr(scheduler, "update_from_output", recorded_update)
    [output] = tight_llm.generate(["the cat sees"],
                                  scripted_params(wide_plans(hook_ids, 6, 90),
                                                  hook_ids, 100),
                                  use_tqdm=False)
    assert [len(child.token_ids)
            for child in promise_tree(output).children] == [91] * 6
    assert preempted and all("/promise-" in request_id
                             for request_id in preempted), preempted
    # Only the root's outputs left the engine core, with every event.
    [root_id] = sent
    assert "/promise-" not in root_id
    assert sent[root_id] == len(preempted)
    assert_engine_clean(tight_llm)


# Seeded parents: each promises, syncs at once, and samples 10 more words
# after the merge; its child writes 6. Seeds by request id.
SEEDS = {"a": 11, "b": 12}


def seeded_plans(hook_ids):
    return {
        (): [NONE, hook_ids.promise, hook_ids.sync] + [NONE] * 10,
        (0, ): [NONE] * 6
    }


def seeded_prompt(name: str) -> list[int]:
    """A 90-token prompt of words, one per seeded parent."""
    stride = 3 + sorted(SEEDS).index(name)
    return [7 + i * stride % 30 for i in range(90)]


def run_seeded_parents(llm, hook_ids, names,
                       monkeypatch) -> tuple[dict[str, tuple], set[str]]:
    """Runs the seeded parents ``names`` together to the end on ``llm``.

    Each prompt is 90 tokens (three blocks), so two parked parents and a
    child's copy of a partial block fill the 7-block pool.

    Returns:
        Each request's final (token ids, text), and the requests whose
        parked parent was evicted.
    """
    engine = llm.llm_engine
    scheduler = scheduler_of(llm)
    evicted = set()
    evict = scheduler.hooks.parking.evict

    def recorded_evict(request):
        evicted.add(request.request_id.rsplit("-", 1)[0])
        return evict(request)

    for name in names:
        params = scripted_params(seeded_plans(hook_ids), hook_ids, 40)
        params.temperature, params.seed = 1.0, SEEDS[name]
        engine.add_request(name, {"prompt_token_ids": seeded_prompt(name)},
                           params)
    results = {}
    with monkeypatch.context() as patch:
        patch.setattr(scheduler.hooks.parking, "evict", recorded_evict)
        while engine.has_unfinished_requests():
            results.update({
                out.request_id:
                (list(out.outputs[0].token_ids), out.outputs[0].text)
                for out in engine.step() if out.finished
            })
    assert_engine_clean(llm)
    return results, evicted


def test_an_evicted_seeded_parent_samples_as_without_pressure(
        tighter_llm, hook_ids, monkeypatch):
    """A resumed parent keeps its generator, evicted or not: the model
    runner still holds its request (an eviction frees only KV blocks), and
    the recomputing resume reaches it as the session's next chunk."""
    alone = {}
    for name in SEEDS:
        results, evicted = run_seeded_parents(tighter_llm, hook_ids, [name],
                                              monkeypatch)
        assert not evicted
        alone.update(results)
    together, evicted = run_seeded_parents(tighter_llm, hook_ids, list(SEEDS),
                                           monkeypatch)
    assert evicted, "no parked parent was evicted"
    assert together == alone
    # Not a replay of the seed: a fresh request with the seed over the
    # merged context samples other words than the resumed parent did.
    [name] = sorted(evicted)[:1]
    token_ids, _ = together[name]
    resumed_at = len(token_ids) - 11
    params = scripted_params(seeded_plans(hook_ids),
                             hook_ids,
                             11,
                             role=(),
                             step=3)
    params.temperature, params.seed = 1.0, SEEDS[name]
    [fresh] = tighter_llm.generate(
        {"prompt_token_ids": seeded_prompt(name) + token_ids[:resumed_at]},
        params,
        use_tqdm=False)
    assert len(fresh.outputs[0].token_ids) == 11
    assert list(fresh.outputs[0].token_ids) != token_ids[resumed_at:]
    assert_engine_clean(tighter_llm)
