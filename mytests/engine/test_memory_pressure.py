# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A KV cache so small that children force preemption and parked parents
hold scarce blocks: every request finishes, greedy outputs equal the same
requests on a large cache, and requests that can never fit are refused the
way stock vLLM refuses them."""

import pytest

from sequence_hooks_testkit.engines import (assert_engine_clean, run_hooked,
                                            tiny_llm)
from sequence_hooks_testkit.oracle import scripted
from vllm import SamplingParams

BLOCK_SIZE = 16
NUM_BLOCKS = 12
MAX_STEPS = 5000
PROMPTS = ["the cat sees", "one two three", "big red dog", "a small bird"]


@pytest.fixture(scope="module")
def small_cache_llm(tiny_model_path, hook_ids):
    return tiny_llm(tiny_model_path,
                    hook_ids,
                    max_model_len=160,
                    block_size=BLOCK_SIZE,
                    num_gpu_blocks_override=NUM_BLOCKS)


def programs(ids):
    P, S = ids.promise, ids.sync
    return [{
        (): [None, P, P, S] + [None] * 4,
        (0, ): [None] * (20 + 5 * i),
        (1, ): [None] * (30 - 5 * i),
    } for i in range(len(PROMPTS))]


def test_outputs_survive_preemption_unchanged(small_cache_llm, hooked_llm,
                                              hook_ids):
    engine = small_cache_llm.llm_engine
    scheduler = engine.scheduler[0]
    assert scheduler.block_manager.num_total_gpu_blocks == NUM_BLOCKS
    preemptions = scheduler.num_cumulative_preemption
    for i, (prompt, plans) in enumerate(zip(PROMPTS, programs(hook_ids))):
        engine.add_request(
            f"tight-{i}", prompt,
            SamplingParams(temperature=0.0,
                           max_tokens=64,
                           logits_processors=[scripted(plans, hook_ids)]))
    small = {}
    # Bounded: a deadlock fails here instead of hanging.
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        small.update((o.request_id, o) for o in engine.step() if o.finished)
    else:
        raise AssertionError(f"not finished after {MAX_STEPS} steps")
    large = run_hooked(hooked_llm, hook_ids, PROMPTS, programs(hook_ids))
    assert scheduler.num_cumulative_preemption > preemptions
    for i, roomy in enumerate(large):
        tight = small[f"tight-{i}"]
        assert tight.outputs[0].token_ids == roomy.outputs[0].token_ids
        assert tight.outputs[0].finish_reason == "stop"
        assert [c.token_ids for c in tight.promise_tree.children
                ] == [c.token_ids for c in roomy.promise_tree.children]
    engine.step()  # the engine forgets finished ids at its next step
    assert_engine_clean(small_cache_llm)


def test_request_that_can_never_fit_is_refused_like_stock(
        small_cache_llm, hook_ids):
    # max_model_len (160) fits the cache (192 tokens), as vLLM checks at
    # start; a longer prompt is refused when it is added, hooks or not.
    too_long = " ".join(["the"] * 161)
    params = SamplingParams(temperature=0.0,
                            max_tokens=8,
                            logits_processors=[scripted({}, hook_ids)])
    with pytest.raises(ValueError, match="longer than the maximum model"):
        small_cache_llm.generate([too_long], params, use_tqdm=False)
    assert_engine_clean(small_cache_llm)
    [output] = small_cache_llm.generate(["the cat sees"],
                                        params,
                                        use_tqdm=False)
    assert output.finished
