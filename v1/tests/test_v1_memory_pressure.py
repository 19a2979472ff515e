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
engines' logits do not matter) and leave every block free.
"""

import pytest

from sequence_hooks_testkit.conformance import assert_fuzz_outcome, hook_odds
from sequence_hooks_testkit.v1_engines import (assert_engine_clean,
                                               run_to_the_end, scheduler_of,
                                               v1_llm)
from sequence_hooks_testkit.v1_scripted_logits import POLICY_KEY
from vllm import SamplingParams

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


@pytest.fixture(scope="module")
def tight_llm(tiny_model_path, hook_ids):
    # 12 blocks: 11 usable (one is the pool's null block).
    return v1_llm(tiny_model_path,
                  hook_ids,
                  block_size=BLOCK_SIZE,
                  num_gpu_blocks_override=12,
                  max_model_len=128)


@pytest.fixture(scope="module")
def tighter_llm(tiny_model_path, hook_ids):
    # 7 usable blocks: the parked parents alone fill them.
    return v1_llm(tiny_model_path,
                  hook_ids,
                  block_size=BLOCK_SIZE,
                  num_gpu_blocks_override=8,
                  max_model_len=128)


def test_trees_finish_under_preemption_and_free_every_block(
        tight_llm, hook_ids, roomy_results, monkeypatch):
    scheduler = scheduler_of(tight_llm)
    preempted = []
    preempt = scheduler._preempt_request

    def counted(request, *args, **kwargs):
        preempted.append(request.request_id)
        return preempt(request, *args, **kwargs)

    monkeypatch.setattr(scheduler, "_preempt_request", counted)
    assert run_trees(tight_llm, hook_ids, monkeypatch) == roomy_results
    assert preempted, "the pool was not tight: nothing was preempted"


def test_parked_parents_are_evicted_and_recompute_at_resume(
        tighter_llm, hook_ids, roomy_results, monkeypatch):
    scheduler = scheduler_of(tighter_llm)
    scheduler.computed_log = []
    # (request id, tokens of its next chunk, computed_log length) of each
    # resume of an evicted parent.
    resumes = []
    merge = scheduler._merge

    def recorded_merge(request, *args, **kwargs):
        evicted = request.request_id in scheduler.evicted
        num_computed = request.num_computed_tokens
        merge(request, *args, **kwargs)
        if evicted:
            assert request.num_computed_tokens == 0
            resumes.append(
                (request.request_id, request.num_tokens - num_computed,
                 len(scheduler.computed_log)))

    monkeypatch.setattr(scheduler, "_merge", recorded_merge)
    try:
        assert run_trees(tighter_llm, hook_ids, monkeypatch) == roomy_results
        computed_log = scheduler.computed_log
    finally:
        scheduler.computed_log = None
    assert resumes, "no parked parent was evicted"
    # Each evicted parent's first step after its resume computes more than
    # its next chunk (`<sync>` and the merged tokens): its context too,
    # less what the prefix cache gave back.
    recomputed = [
        next(n for _, request_id, n in computed_log[start:]
             if request_id == resumed) - chunk
        for resumed, chunk, start in resumes
    ]
    assert any(n > 0 for n in recomputed), recomputed
