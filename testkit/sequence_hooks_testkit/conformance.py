# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The checks both flavours' suites run, V0 (the fork) and V1 (the plugin).

A `Flavour` says how a flavour scripts a request, where it puts the tree
and what "nothing left behind" means for its engine; each check runs the
same program and makes the same assertions on either. `FlavourConformance`
holds them as tests: each suite (mytests/ for V0, v1/tests/ for V1)
subclasses it with its flavour, over its session's `hooked_llm`,
`plain_llm` and `hook_ids` fixtures.
"""

from dataclasses import dataclass
from typing import Callable

import pytest

from sequence_hooks_testkit.oracle import ReferenceNode, reference
from sequence_hooks_testkit.programs import NONE, PROMPTS, programs

# The named programs every flavour is proven on (`programs.programs`).
PROGRAM_NAMES = [
    "one promise", "several promises", "nested",
    "sync before the child finishes", "sync after the child finished",
    "two rounds", "sync without children"
]


@dataclass(frozen=True)
class Flavour:
    """How the checks drive one engine flavour."""

    # (plans, ids, max_tokens=64, role=..., step=...) -> greedy
    # SamplingParams running the program (see `oracle.scripted_params`).
    scripted_params: Callable
    # A finished RequestOutput -> its `PromiseNode` tree, or None.
    promise_tree: Callable
    # (RequestOutput, one of its CompletionOutputs) -> that sample's tree.
    sample_tree: Callable
    # An LLM -> None; asserts no request, tree or used KV block is left.
    assert_engine_clean: Callable


def run_hooked(flavour: Flavour,
               llm,
               ids,
               prompts,
               plan_list,
               max_tokens: int = 64):
    """Runs one program per prompt on a hooked engine, greedy.

    Returns:
        The `RequestOutput`s, in prompt order.
    """
    return llm.generate(prompts, [
        flavour.scripted_params(plans, ids, max_tokens) for plans in plan_list
    ],
                        use_tqdm=False)


def expected_of(flavour: Flavour, plain_llm, ids, plans,
                prompt_ids) -> ReferenceNode:
    """The program's hook-free reference on ``plain_llm``."""
    return reference(plain_llm,
                     ids,
                     plans,
                     prompt_ids,
                     params_of=flavour.scripted_params)


def assert_tree_matches(node, expected: ReferenceNode) -> None:
    """A promise tree has the reference's children and tokens."""
    assert len(node.children) == len(expected.children)
    for child, expected_child in zip(node.children, expected.children):
        assert list(child.token_ids) == expected_child.token_ids
        assert child.finish_reason == "stop"
        assert child.parent is node
        assert_tree_matches(child, expected_child)


def check_program(flavour: Flavour, hooked_llm, plain_llm, ids,
                  name: str) -> None:
    """A named program's tokens, tree and text equal the reference's."""
    plans = programs(ids)[name]
    [output] = run_hooked(flavour, hooked_llm, ids, ["the cat sees"], [plans])
    expected = expected_of(flavour, plain_llm, ids, plans,
                           output.prompt_token_ids)
    completion = output.outputs[0]
    assert list(completion.token_ids) == expected.token_ids
    assert completion.finish_reason == "stop"
    tree = flavour.promise_tree(output)
    if expected.children:
        assert list(tree.token_ids) == expected.token_ids
        assert_tree_matches(tree, expected)
        # The parent's text carries the merged children's texts.
        for child in tree.children:
            assert child.text.strip()
            assert child.text.strip() in completion.text
    else:
        assert tree is None
    flavour.assert_engine_clean(hooked_llm)


def check_many_requests(flavour: Flavour, hooked_llm, plain_llm, ids) -> None:
    """All named programs at once, one per prompt, each as the reference."""
    named = list(programs(ids).values())
    plan_list = [named[i % len(named)] for i in range(len(PROMPTS))]
    outputs = run_hooked(flavour, hooked_llm, ids, PROMPTS, plan_list)
    assert [o.prompt for o in outputs] == PROMPTS
    for output, plans in zip(outputs, plan_list):
        expected = expected_of(flavour, plain_llm, ids, plans,
                               output.prompt_token_ids)
        assert list(output.outputs[0].token_ids) == expected.token_ids
    flavour.assert_engine_clean(hooked_llm)


def check_parent_eos_aborts_live_children(flavour: Flavour, hooked_llm,
                                          plain_llm, ids,
                                          tokens_after_promise: int) -> None:
    """A parent that ends with a live child aborts it, its own tokens
    unchanged. With 0 tokens after the promise the parent ends in the very
    step its child's first chunk runs."""
    plans = {
        (): [NONE, ids.promise] + [NONE] * tokens_after_promise,
        (0, ): [NONE] * 30
    }
    [output] = run_hooked(flavour, hooked_llm, ids, ["the cat sees"], [plans])
    expected = expected_of(flavour, plain_llm, ids, {(): plans[()]},
                           output.prompt_token_ids)
    assert list(output.outputs[0].token_ids) == expected.token_ids
    [child] = flavour.promise_tree(output).children
    assert child.finish_reason == "abort"
    flavour.assert_engine_clean(hooked_llm)


def check_promise_storm(flavour: Flavour, hooked_llm, ids) -> None:
    """Every sequence promises at every step: the default limits (16
    children per sequence, 64 per request, depth 2) hold; which one bites
    first depends on how the levels interleave."""
    storm = [ids.promise] * 24
    plans = {(): storm + [ids.sync, NONE]}
    for k in range(16):
        plans[(k, )] = storm[:4]
        for j in range(4):
            plans[(k, j)] = storm[:2]
    [output] = run_hooked(flavour,
                          hooked_llm,
                          ids, ["the cat sees"], [plans],
                          max_tokens=200)
    tree = flavour.promise_tree(output)
    assert 0 < len(tree.children) <= 16
    assert sum(1 + len(child.children) for child in tree.children) == 64
    assert all(not grandchild.children for child in tree.children
               for grandchild in child.children)
    assert output.outputs[0].finish_reason == "stop"
    flavour.assert_engine_clean(hooked_llm)


def check_child_stop_string_cuts_its_text(flavour: Flavour, hooked_llm,
                                          ids) -> None:
    """A child honours its request's stop strings, as V0's stop checker
    has it: it ends with "stop", its text cut before the stop string, and
    its parent merges the cut text."""
    plans = programs(ids)["one promise"]
    [full] = run_hooked(flavour, hooked_llm, ids, PROMPTS[:1], [plans])
    [child] = flavour.promise_tree(full).children
    # A word of the child's that its parent does not write itself.
    stop = next(" " + word for word in child.text.split()[1:] if " " +
                word not in full.outputs[0].text.replace(child.text, ""))
    params = flavour.scripted_params(plans, ids)
    params.stop = [stop]
    [output] = hooked_llm.generate(PROMPTS[:1], params, use_tqdm=False)
    [stopped] = flavour.promise_tree(output).children
    assert stopped.finish_reason == "stop"
    assert stopped.text == child.text[:child.text.index(stop)]
    assert stopped.text in output.outputs[0].text
    flavour.assert_engine_clean(hooked_llm)


def sampled_logprobs(token_ids, logprobs) -> list:
    """Per token, the sampled token's logprob (None where no entry)."""
    return [
        None if entry is None else entry[token].logprob
        for token, entry in zip(token_ids, logprobs)
    ]


def check_tree_logprobs(flavour: Flavour, hooked_llm, plain_llm, ids) -> None:
    """With `logprobs`, the tree says which tokens were merged (no entry)
    and gives each child the logprobs a hook-free request over its context
    reports; the request's own logprobs give merged tokens 0.0."""
    plans = programs(ids)["one promise"]
    params = flavour.scripted_params(plans, ids, 48)
    params.logprobs = 2
    [output] = hooked_llm.generate(["the cat sees"], params, use_tqdm=False)
    root = flavour.promise_tree(output)
    [child] = root.children
    completion = output.outputs[0]
    # The root is the request's own sequence: its tokens are the output's.
    assert root.token_ids == tuple(completion.token_ids)
    assert root.text == completion.text
    # One merge, right after <sync>: given tokens, no logprob.
    [(start, count)] = root.merged_spans
    assert root.token_ids[start - 1] == ids.sync
    assert count == root.num_merged_tokens > 0
    assert root.sampled_mask == tuple(not start <= i < start + count
                                      for i in range(len(root.token_ids)))
    assert [lp is None for lp in root.logprobs
            ] == [not sampled for sampled in root.sampled_mask]
    assert sampled_logprobs(completion.token_ids,
                            completion.logprobs)[start:start +
                                                 count] == [0.0] * count
    # The child was generated from the prompt, the root's tokens up to its
    # <promise>, and the role marker: a plain request over that context
    # samples the same tokens with the same logprobs.
    assert root.token_ids[child.fork_position - 1] == ids.promise
    context = (output.prompt_token_ids +
               list(root.token_ids[:child.fork_position]) + [ids.child])
    params = flavour.scripted_params(plans,
                                     ids,
                                     len(child.token_ids),
                                     role=(0, ))
    params.logprobs = 2
    [plain] = plain_llm.generate({"prompt_token_ids": context},
                                 params,
                                 use_tqdm=False)
    plain = plain.outputs[0]
    assert child.token_ids == tuple(plain.token_ids)
    assert [sorted(entry) for entry in child.logprobs
            ] == [sorted(entry) for entry in plain.logprobs]
    assert sampled_logprobs(child.token_ids,
                            child.logprobs) == pytest.approx(sampled_logprobs(
                                plain.token_ids, plain.logprobs),
                                                             abs=1e-4)
    assert child.cumulative_logprob == pytest.approx(plain.cumulative_logprob,
                                                     abs=1e-3)
    flavour.assert_engine_clean(hooked_llm)


def seeded_params(flavour: Flavour, plans, ids, **fixed):
    """The flavour's scripted params, sampled at temperature 1 with a
    seed."""
    params = flavour.scripted_params(plans, ids, 40, **fixed)
    params.temperature, params.seed = 1.0, 1234
    return params


def check_seeded_children_have_their_own_streams(flavour: Flavour, hooked_llm,
                                                 ids) -> None:
    """A seeded request is reproducible, and its children, same context
    and plan, sample differently (each has its own derived seed)."""
    plans = {
        (): [NONE, ids.promise, ids.promise, ids.sync, NONE],
        (0, ): [NONE] * 8,
        (1, ): [NONE] * 8,
    }

    def run():
        [output] = hooked_llm.generate(["the cat sees"],
                                       seeded_params(flavour, plans, ids),
                                       use_tqdm=False)
        return output

    first, again = run(), run()
    assert first.outputs[0].token_ids == again.outputs[0].token_ids
    texts = [child.text for child in flavour.promise_tree(first).children]
    assert texts == [
        child.text for child in flavour.promise_tree(again).children
    ]
    assert texts[0] != texts[1]
    flavour.assert_engine_clean(hooked_llm)


def check_child_does_not_replay_its_parents_seed(flavour: Flavour, hooked_llm,
                                                 ids) -> None:
    """A child's generator starts at its first step. Seeded with the
    parent's seed, it would sample exactly what a fresh request with that
    seed samples over the same context."""
    plans = {(): [NONE, ids.promise, ids.sync], (0, ): [NONE] * 12}
    [output] = hooked_llm.generate(["the cat sees"],
                                   seeded_params(flavour, plans, ids),
                                   use_tqdm=False)
    [child] = flavour.promise_tree(output).children
    context = (output.prompt_token_ids +
               list(output.outputs[0].token_ids[:2]) + [ids.child])
    params = seeded_params(flavour, plans, ids, role=(0, ))
    params.max_tokens = len(child.token_ids)
    [fresh] = hooked_llm.generate({"prompt_token_ids": context},
                                  params,
                                  use_tqdm=False)
    assert len(fresh.outputs[0].token_ids) == len(child.token_ids)
    assert list(fresh.outputs[0].token_ids) != list(child.token_ids)
    flavour.assert_engine_clean(hooked_llm)


def without_request_ids(data: dict) -> dict:
    """A tree's `to_dict` without the request ids (which differ between
    samples and runs)."""
    return {
        **{
            key: value
            for key, value in data.items() if key != "request_id"
        },
        "children": [without_request_ids(c) for c in data["children"]],
    }


def check_parallel_samples(flavour: Flavour, hooked_llm, ids, n: int) -> None:
    """With `n > 1` and a seed, each sample runs its own tree (merges
    included) and gets it: its root is the sample's tokens and text, one
    merge of its three children after `<sync>`, each child its plan's
    length and in the sample's text. Samples differ, a rerun gives the
    same trees, and the request reports no tree of its own."""
    plans = programs(ids)["several promises"]

    def run():
        params = flavour.scripted_params(plans, ids)
        params.n, params.temperature, params.seed = n, 1.0, 3
        [output] = hooked_llm.generate(["the cat sees"],
                                       params,
                                       use_tqdm=False)
        return output

    output = run()
    assert len(output.outputs) == n
    trees = []
    for completion in output.outputs:
        assert completion.finish_reason == "stop"
        tree = flavour.sample_tree(output, completion)
        assert tree.token_ids == tuple(completion.token_ids)
        assert tree.text == completion.text
        [(start, count)] = tree.merged_spans
        assert tree.token_ids[start - 1] == ids.sync
        assert count == tree.num_merged_tokens > 0
        assert len(tree.children) == 3
        for k, child in enumerate(tree.children):
            assert child.finish_reason == "stop"
            # Its plan, then the EOS the script forces.
            assert len(child.token_ids) == len(plans[(k, )]) + 1
            assert child.text.strip() in completion.text
        trees.append(without_request_ids(tree.to_dict()))
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    assert flavour.promise_tree(output) is None
    again = run()
    assert [
        without_request_ids(flavour.sample_tree(again, c).to_dict())
        for c in again.outputs
    ] == trees
    flavour.assert_engine_clean(hooked_llm)


def check_greedy_samples_have_equal_trees(flavour: Flavour, hooked_llm,
                                          plain_llm, ids) -> None:
    """Greedy `n = 2`: both samples are the hook-free (greedy) reference,
    and so are their trees, which are equal but for the request ids.
    Greedy as top-k 1: both engines refuse `n > 1` at temperature 0 (the
    seed only tells V1's scripts the samples apart)."""
    plans = programs(ids)["several promises"]
    params = flavour.scripted_params(plans, ids)
    params.n, params.temperature, params.top_k, params.seed = 2, 1.0, 1, 3
    [output] = hooked_llm.generate(["the cat sees"], params, use_tqdm=False)
    expected = expected_of(flavour, plain_llm, ids, plans,
                           output.prompt_token_ids)
    trees = []
    for completion in output.outputs:
        assert list(completion.token_ids) == expected.token_ids
        tree = flavour.sample_tree(output, completion)
        assert list(tree.token_ids) == expected.token_ids
        assert_tree_matches(tree, expected)
        trees.append(without_request_ids(tree.to_dict()))
    assert len(trees) == 2 and trees[0] == trees[1]
    flavour.assert_engine_clean(hooked_llm)


def hook_metric(llm, name: str) -> float:
    """The value of `vllm:sequence_hook_<name>` for ``llm``'s model, as the
    hooks' process exports it (0 if never set)."""
    import prometheus_client
    model_name = llm.llm_engine.model_config.served_model_name
    value = prometheus_client.REGISTRY.get_sample_value(
        f"vllm:sequence_hook_{name}", {"model_name": model_name})
    return value or 0.0


def check_metrics(flavour: Flavour, hooked_llm, ids) -> None:
    """The hook metrics count what a program did."""
    names = [
        "promises_spawned_total", "syncs_blocked_total", "merged_tokens_total",
        "blocked_time_seconds_count", "children_running"
    ]
    before = {name: hook_metric(hooked_llm, name) for name in names}
    plans = programs(ids)["several promises"]
    [output] = run_hooked(flavour, hooked_llm, ids, ["the cat sees"], [plans])
    grown = {
        name: hook_metric(hooked_llm, name) - before[name]
        for name in names
    }
    assert grown == {
        "promises_spawned_total": 3,
        "syncs_blocked_total": 1,
        "merged_tokens_total": flavour.promise_tree(output).num_merged_tokens,
        "blocked_time_seconds_count": 1,
        "children_running": 0,
    }
    flavour.assert_engine_clean(hooked_llm)


def fuzz_cases(**extra):
    """Hypothesis cases of the random-tree fuzz: a seed, requests, budget,
    hook limits, per-step hook odds and an abort rate, plus ``extra``."""
    # Here, not at the top: V1's logits processors, which servers load,
    # import this module too.
    from hypothesis import strategies as st
    return st.fixed_dictionaries(
        dict(seed=st.integers(0, 2**32 - 1),
             requests=st.integers(1, 6),
             max_tokens=st.integers(4, 40),
             max_children_per_sequence=st.integers(1, 4),
             max_children_per_request=st.integers(1, 8),
             max_depth=st.integers(1, 3),
             promise_p=st.floats(0.0, 0.4),
             sync_p=st.floats(0.0, 0.4),
             eos_p=st.floats(0.0, 0.2),
             abort_p=st.floats(0.0, 0.05),
             **extra))


def hook_odds(case: dict, ids) -> list[tuple[int, float]]:
    """(token id, probability) of each hook token at a step of ``case``."""
    return [(ids.promise, case["promise_p"]), (ids.sync, case["sync_p"]),
            (ids.eos, case["eos_p"])]


def pick_token(draw: float, odds: list[tuple[int, float]],
               choose_word: Callable[[], int]) -> int:
    """The hook token a uniform ``draw`` in [0, 1) falls on, else a word.

    Args:
        draw: A uniform draw.
        odds: (token id, probability) of each hook token.
        choose_word: Picks a word; called only when no hook is drawn.
    """
    for token_id, p in odds:
        if draw < p:
            return token_id
        draw -= p
    return choose_word()


def assert_fuzz_outcome(roots: list[str], aborted: set[str],
                        finished: list[str], output_ids: set[str]) -> None:
    """Only roots produced outputs, each at most one final output, and
    every root not aborted exactly one."""
    assert output_ids <= set(roots)
    assert len(finished) == len(set(finished))
    assert set(roots) - aborted <= set(finished)


class FlavourConformance:
    """The shared checks as pytest tests; a suite subclasses it as
    `TestConformance` and sets `flavour`."""

    # The flavour the subclass runs the checks on.
    flavour: Flavour

    @pytest.mark.parametrize("name", PROGRAM_NAMES)
    def test_program_matches_the_hook_free_reference(self, hooked_llm,
                                                     plain_llm, hook_ids,
                                                     name):
        check_program(self.flavour, hooked_llm, plain_llm, hook_ids, name)

    def test_many_requests_at_once(self, hooked_llm, plain_llm, hook_ids):
        check_many_requests(self.flavour, hooked_llm, plain_llm, hook_ids)

    @pytest.mark.parametrize("tokens_after_promise", [0, 1])
    def test_parent_eos_aborts_live_children(self, hooked_llm, plain_llm,
                                             hook_ids, tokens_after_promise):
        check_parent_eos_aborts_live_children(self.flavour, hooked_llm,
                                              plain_llm, hook_ids,
                                              tokens_after_promise)

    def test_promise_storm_stays_within_the_limits(self, hooked_llm, hook_ids):
        refused = hook_metric(hooked_llm, "promises_refused_total")
        check_promise_storm(self.flavour, hooked_llm, hook_ids)
        assert hook_metric(hooked_llm, "promises_refused_total") > refused

    def test_a_child_stops_at_its_requests_stop_string(self, hooked_llm,
                                                       hook_ids):
        check_child_stop_string_cuts_its_text(self.flavour, hooked_llm,
                                              hook_ids)

    def test_metrics_count_what_the_hooks_did(self, hooked_llm, hook_ids):
        check_metrics(self.flavour, hooked_llm, hook_ids)

    def test_nodes_carry_logprobs_a_hook_free_request_reports(
            self, hooked_llm, plain_llm, hook_ids):
        check_tree_logprobs(self.flavour, hooked_llm, plain_llm, hook_ids)

    def test_seeded_sampling_gives_each_child_its_own_stream(
            self, hooked_llm, hook_ids):
        check_seeded_children_have_their_own_streams(self.flavour, hooked_llm,
                                                     hook_ids)

    def test_a_child_does_not_replay_its_parents_seed(self, hooked_llm,
                                                      hook_ids):
        check_child_does_not_replay_its_parents_seed(self.flavour, hooked_llm,
                                                     hook_ids)

    @pytest.mark.parametrize("n", [2, 3])
    def test_parallel_samples_each_get_their_own_tree(self, hooked_llm,
                                                      hook_ids, n):
        check_parallel_samples(self.flavour, hooked_llm, hook_ids, n)

    def test_greedy_samples_get_equal_trees(self, hooked_llm, plain_llm,
                                            hook_ids):
        check_greedy_samples_have_equal_trees(self.flavour, hooked_llm,
                                              plain_llm, hook_ids)
