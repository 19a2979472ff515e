# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Promise trees on a V1 engine whose KV pool cannot hold them all.

Random trees (the fuzz's policy) over six requests on 11 usable blocks of
32 tokens: running members get preempted and recomputed by upstream's
scheduler, parked parents keep their blocks; every tree must still finish
and leave every block free. Its own engine (a second one in the session:
its logits may differ from a lone engine's, which this test does not
compare). docs/v1.md says what a pool too small for the parked parents
does.
"""

import pytest

from sequence_hooks_testkit.conformance import assert_fuzz_outcome, hook_odds
from sequence_hooks_testkit.v1_engines import (assert_engine_clean,
                                               run_to_the_end, scheduler_of,
                                               v1_llm)
from sequence_hooks_testkit.v1_scripted_logits import POLICY_KEY
from vllm import SamplingParams

NUM_BLOCKS = 12
BLOCK_SIZE = 32
MAX_STEPS = 3000


@pytest.fixture(scope="module")
def tight_llm(tiny_model_path, hook_ids):
    return v1_llm(tiny_model_path,
                  hook_ids,
                  block_size=BLOCK_SIZE,
                  num_gpu_blocks_override=NUM_BLOCKS,
                  max_model_len=128)


def test_trees_finish_under_preemption_and_free_every_block(
        tight_llm, hook_ids, monkeypatch):
    engine = tight_llm.llm_engine
    scheduler = scheduler_of(tight_llm)
    preempted = []
    preempt = scheduler._preempt_request

    def counted(request, *args, **kwargs):
        preempted.append(request.request_id)
        return preempt(request, *args, **kwargs)

    monkeypatch.setattr(scheduler, "_preempt_request", counted)
    case = {"promise_p": 0.2, "sync_p": 0.1, "eos_p": 0.02}
    policy = {
        "seed": 1,
        "words": list(range(7, 40)),
        "hooks": hook_odds(case, hook_ids)
    }
    roots = [str(i) for i in range(6)]
    for i, request_id in enumerate(roots):
        engine.add_request(
            request_id, {"prompt_token_ids": [7 + i, 8, 9, 10]},
            SamplingParams(temperature=0.0,
                           max_tokens=60,
                           extra_args={POLICY_KEY: policy}))
    finished, output_ids = run_to_the_end(engine, MAX_STEPS)
    assert preempted, "the pool was not tight: nothing was preempted"
    assert_fuzz_outcome(roots, set(), finished, output_ids)
    assert_engine_clean(tight_llm)
