# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Property-based: random promise/sync programs on the real engine, against
the hook-free oracle.

Hypothesis draws programs: a parent writes words, promises (up to 3 children
each) and syncs anywhere, children do the same one level down (depth 2),
some parents end with children still running. Several run at once. After
each case: the parents' tokens equal the oracle's, every child that
finished equals its reference, and the engine is left clean. Examples per
run: HOOK_FUZZ_E2E_EXAMPLES (CI default below).
"""

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sequence_hooks_testkit.engines import assert_engine_clean, run_hooked
from sequence_hooks_testkit.oracle import reference

EXAMPLES = int(os.environ.get("HOOK_FUZZ_E2E_EXAMPLES", "6"))
PROMPTS = ["the cat sees", "one two three", "big red dog", "a small bird"]


@st.composite
def program(draw, depth=0):
    """A (plan, children) tree with "P"/"S" placeholders for hook tokens."""
    kinds = ["word", "word", "sync"] + (["promise"] if depth < 2 else [])
    plan, children = [], []
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(kinds))
        if kind == "promise" and len(children) < 3:
            plan.append("P")
            children.append(draw(program(depth + 1)))
        else:
            plan.append("S" if kind == "sync" else None)
    return plan, children


def plans_of(tree, ids, role=()) -> dict:
    plan, children = tree
    tokens = {"P": ids.promise, "S": ids.sync, None: None}
    plans = {role: [tokens[t] for t in plan]}
    for k, child in enumerate(children):
        plans.update(plans_of(child, ids, role + (k, )))
    return plans


def assert_finished_children_match(node, expected):
    for child, expected_child in zip(node.children, expected.children):
        if child.finish_reason == "stop":
            assert list(child.token_ids) == expected_child.token_ids
            assert_finished_children_match(child, expected_child)


@settings(max_examples=EXAMPLES,
          deadline=None,
          suppress_health_check=[
              HealthCheck.function_scoped_fixture, HealthCheck.too_slow
          ])
@given(trees=st.lists(program(), min_size=1, max_size=len(PROMPTS)))
def test_random_programs_match_the_oracle(hooked_llm, plain_llm, hook_ids,
                                          trees):
    plan_list = [plans_of(tree, hook_ids) for tree in trees]
    prompts = PROMPTS[:len(trees)]
    outputs = run_hooked(hooked_llm,
                         hook_ids,
                         prompts,
                         plan_list,
                         max_tokens=200)
    assert [o.prompt for o in outputs] == prompts
    for output, plans in zip(outputs, plan_list):
        expected = reference(plain_llm, hook_ids, plans,
                             output.prompt_token_ids)
        assert list(output.outputs[0].token_ids) == expected.token_ids
        if output.promise_tree is not None:
            assert_finished_children_match(output.promise_tree, expected)
    assert_engine_clean(hooked_llm)


@settings(max_examples=EXAMPLES,
          deadline=None,
          suppress_health_check=[
              HealthCheck.function_scoped_fixture, HealthCheck.too_slow
          ])
@given(trees=st.lists(program(), min_size=1, max_size=len(PROMPTS)),
       abort_steps=st.lists(st.integers(0, 30), max_size=len(PROMPTS)))
def test_random_aborts_leave_the_engine_clean_and_usable(
        hooked_llm, hook_ids, trees, abort_steps):
    from sequence_hooks_testkit.oracle import scripted
    from vllm import SamplingParams
    engine = hooked_llm.llm_engine
    request_ids = [f"fuzz-abort-{i}" for i in range(len(trees))]
    for request_id, tree, prompt in zip(request_ids, trees, PROMPTS):
        engine.add_request(
            request_id, prompt,
            SamplingParams(temperature=0.0,
                           max_tokens=200,
                           logits_processors=[
                               scripted(plans_of(tree, hook_ids), hook_ids)
                           ]))
    aborts = dict(zip(abort_steps, request_ids))
    for step in range(2000):
        if step in aborts:
            engine.abort_request(aborts[step])
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            assert output.request_id in request_ids
    engine.step()  # the engine forgets finished ids at its next step
    assert_engine_clean(hooked_llm)
