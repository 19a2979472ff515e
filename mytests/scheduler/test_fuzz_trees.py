# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Property-based: random promise trees on the real scheduler, no model.

Hypothesis draws a KV cache size, prefix caching on or off (which changes
when parked parents are evicted), hook limits, requests and a seed; a
seeded policy then picks every group's token at every step (promise,
sync, EOS or a word) and aborts random requests at random steps. After
each case: every KV block is free, no group is parked or queued, no
registry entry is left, no child produced an output, every request that
was not aborted produced exactly one final output. The number of examples
comes from HOOK_FUZZ_EXAMPLES (CI default below; see docs/reliability.md
for the long run).
"""

import os
import random

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sequence_hooks_testkit.conformance import (assert_fuzz_outcome,
                                                fuzz_cases, hook_odds,
                                                pick_token)
from sequence_hooks_testkit.harness import HookHarness
from vllm.config import SpecialKwargs
from vllm.sampling_params import SamplingParams
from vllm.sequence import SequenceStatus

EXAMPLES = int(os.environ.get("HOOK_FUZZ_EXAMPLES", "40"))
MAX_STEPS = 3000
WORDS = ["the", "cat", "sees", "dog", "big", "red", "one", "two"]

cases = fuzz_cases(num_gpu_blocks=st.sampled_from([6, 10, 16, 64]),
                   prefix_caching=st.booleans())


@settings(max_examples=EXAMPLES,
          deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases)
# Found by a long run: the scheduler ignores a parent and its child in the
# same step (6 blocks cannot hold them after preemption).
@example(
    case={
        "seed": 2_013_761_439,
        "num_gpu_blocks": 6,
        "requests": 5,
        "max_tokens": 21,
        "max_children_per_sequence": 2,
        "max_children_per_request": 2,
        "max_depth": 1,
        "promise_p": 0.125,
        "sync_p": 0.0,
        "eos_p": 0.0,
        "abort_p": 0.0,
        "prefix_caching": False,
    })
def test_random_trees_leave_nothing_behind(tiny_tokenizer_path, hook_ids,
                                           case):
    rng = random.Random(case["seed"])
    harness = HookHarness(
        tiny_tokenizer_path,
        SpecialKwargs(
            sync_token_id=hook_ids.sync,
            promise_token_id=hook_ids.promise,
            max_children_per_sequence=case["max_children_per_sequence"],
            max_children_per_request=case["max_children_per_request"],
            max_depth=case["max_depth"]),
        num_gpu_blocks=case["num_gpu_blocks"],
        max_model_len=64,
        enable_prefix_caching=case["prefix_caching"])
    words = [harness.tokenizer.convert_tokens_to_ids(w) for w in WORDS]
    roots = [f"r{i}" for i in range(case["requests"])]
    for request_id in roots:
        harness.add(
            request_id, " ".join(rng.choices(WORDS, k=rng.randint(1, 6))),
            SamplingParams(temperature=0.0, max_tokens=case["max_tokens"]))

    def choose(group) -> int:
        return pick_token(rng.random(), hook_odds(case, hook_ids),
                          lambda: rng.choice(words))

    aborted = set()
    free_blocks = harness.free_blocks()
    for _ in range(MAX_STEPS):
        if not harness.scheduler.has_unfinished_seqs():
            break
        if rng.random() < case["abort_p"]:
            victim = rng.choice(roots)
            aborted.add(victim)
            harness.scheduler.abort_seq_group(victim,
                                              harness.seq_id_to_seq_group)
        harness.step(choose=choose)
        for group in harness.scheduler.parked.values():
            assert group.first_seq.status == SequenceStatus.BLOCKED
    else:
        raise AssertionError(f"not done after {MAX_STEPS} steps: {case}")
    harness.step()  # the engine forgets finished ids at the next step

    scheduler = harness.scheduler
    assert harness.free_blocks() == free_blocks
    assert not (scheduler.running or scheduler.waiting or scheduler.swapped
                or scheduler.parked)
    assert harness.seq_id_to_seq_group == {}
    finished = [output.request_id for output in harness.finished_outputs]
    assert_fuzz_outcome(roots, aborted, finished, harness.output_request_ids)
