# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Property-based: random promise trees with aborts on the V1 engine.

Hypothesis draws hook limits, requests and a policy; a logits processor
then picks every sequence's token from a hash of its context (promise,
sync, EOS or a word), and random requests are aborted at random steps.
After each case: every KV block is free, no request, tree or parked
session is left, no child produced an output, every request that was not
aborted produced exactly one final output. The number of examples comes
from HOOK_FUZZ_EXAMPLES (bounded by default).
"""

import os
import random

from hypothesis import HealthCheck, given, settings

from sequence_hooks_testkit.conformance import (assert_fuzz_outcome,
                                                fuzz_cases, hook_odds)
from sequence_hooks_testkit.v1_engines import (assert_engine_clean,
                                               run_to_the_end, scheduler_of)
from sequence_hooks_testkit.v1_scripted_logits import POLICY_KEY
from vllm import SamplingParams

EXAMPLES = int(os.environ.get("HOOK_FUZZ_EXAMPLES", "12"))
MAX_STEPS = 2000


@settings(max_examples=EXAMPLES,
          deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=fuzz_cases())
def test_random_trees_with_aborts_leave_nothing_behind(hooked_llm, hook_ids,
                                                       case):
    engine = hooked_llm.llm_engine
    scheduler = scheduler_of(hooked_llm)
    coordinator = scheduler.hooks.coordinator
    limits = coordinator.special_kwargs
    # The limits are read per promise: each case sets its own.
    coordinator.special_kwargs = type(limits)(
        sync_token_id=hook_ids.sync,
        promise_token_id=hook_ids.promise,
        max_children_per_sequence=case["max_children_per_sequence"],
        max_children_per_request=case["max_children_per_request"],
        max_depth=case["max_depth"])
    rng = random.Random(case["seed"])
    policy = {
        "seed": case["seed"],
        "words": list(range(7, 40)),
        "hooks": hook_odds(case, hook_ids),
    }
    roots = [str(i) for i in range(case["requests"])]
    for request_id in roots:
        prompt = [rng.randrange(7, 60) for _ in range(rng.randint(1, 6))]
        engine.add_request(
            request_id, {"prompt_token_ids": prompt},
            SamplingParams(temperature=0.0,
                           max_tokens=case["max_tokens"],
                           extra_args={POLICY_KEY: policy}))
    aborted = set()

    def maybe_abort():
        if rng.random() < case["abort_p"]:
            victim = rng.choice(roots)
            aborted.add(victim)
            engine.abort_request([victim])

    try:
        finished, output_ids = run_to_the_end(engine, MAX_STEPS, maybe_abort)
    finally:
        coordinator.special_kwargs = limits
    engine.step()  # nothing left: must not raise
    assert_fuzz_outcome(roots, aborted, finished, output_ids)
    assert_engine_clean(hooked_llm)
