# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The promise tree users get from `LLM.generate`: every node's tokens,
text, logprobs and merged spans, one tree per sample with n > 1, and the
training records built from it."""

import pytest

from sequence_hooks import PromiseNode, training_records
from sequence_hooks_testkit import conformance
from sequence_hooks_testkit.engines import assert_engine_clean
from sequence_hooks_testkit.oracle import scripted
from sequence_hooks_testkit.programs import NONE, programs
from vllm import SamplingParams
from vllm.sequence import Logprob

PROMPT = "the cat sees"


def run(llm, plans, ids, **params):
    [output
     ] = llm.generate([PROMPT],
                      SamplingParams(max_tokens=48,
                                     logits_processors=[scripted(plans, ids)],
                                     **{
                                         "temperature": 0.0,
                                         **params
                                     }),
                      use_tqdm=False)
    return output


def test_nodes_carry_no_logprobs_unless_asked(hooked_llm, hook_ids):
    output = run(hooked_llm, programs(hook_ids)["nested"], hook_ids)
    nodes = [output.promise_tree]
    while nodes:
        node = nodes.pop()
        assert node.logprobs is None and node.cumulative_logprob is None
        assert node.finish_reason == "stop" and node.token_ids
        nodes.extend(node.children)


@pytest.mark.parametrize("top_logprobs", [False, True])
def test_a_tree_is_rebuilt_from_its_dict(hooked_llm, hook_ids, top_logprobs):
    # How the V1 plugin's tree crosses its engine-core process boundary.
    output = run(hooked_llm,
                 programs(hook_ids)["nested"],
                 hook_ids,
                 logprobs=2)
    data = output.promise_tree.to_dict(top_logprobs)
    tree = PromiseNode.from_dict(data, Logprob)
    assert tree.to_dict(top_logprobs) == data
    [child] = tree.children
    assert child.parent is tree and child.children[0].parent is child
    original = output.promise_tree.children[0]
    assert child.sampled_mask == original.sampled_mask
    assert conformance.sampled_logprobs(
        child.token_ids, child.logprobs) == conformance.sampled_logprobs(
            original.token_ids, original.logprobs)
    if top_logprobs:
        assert [
            None if entry is None else sorted(entry)
            for entry in child.logprobs
        ] == [
            None if entry is None else sorted(entry)
            for entry in original.logprobs
        ]
    assert_engine_clean(hooked_llm)


def tokens_of(node) -> list:
    """A subtree's tokens, request ids left out."""
    return [node.token_ids] + [tokens_of(child) for child in node.children]


def test_each_sample_has_its_own_tree(hooked_llm, hook_ids):
    plans = programs(hook_ids)["several promises"]

    def sample():
        return run(hooked_llm,
                   plans,
                   hook_ids,
                   n=4,
                   temperature=1.0,
                   seed=11,
                   logprobs=0)

    output, again = sample(), sample()
    # Per-sample trees are on the completions; the request has none.
    assert output.promise_tree is None
    trees = [completion.promise_tree for completion in output.outputs]
    assert len({tree.request_id for tree in trees}) == 4
    for completion, tree in zip(output.outputs, trees):
        assert tree.token_ids == tuple(completion.token_ids)
        assert len(tree.children) == 3
    # Distinct seeds per sample and per child: different children; the
    # same seed again: the same trees.
    texts = [child.text for tree in trees for child in tree.children]
    assert len(set(texts)) == len(texts)
    assert [tokens_of(c.promise_tree)
            for c in again.outputs] == [tokens_of(tree) for tree in trees]
    assert_engine_clean(hooked_llm)


def test_training_records_hold_what_the_engine_ran(hooked_llm, hook_ids,
                                                   monkeypatch):
    hooks = hooked_llm.llm_engine.output_processor.hooks
    finished = hooks.finished
    ran = {}

    def recording_finished(seq_group):
        ran[seq_group.request_id] = seq_group.first_seq.get_token_ids()
        finished(seq_group)

    monkeypatch.setattr(hooks, "finished", recording_finished)
    plans = programs(hook_ids)["nested"]
    output = run(hooked_llm,
                 plans,
                 hook_ids,
                 n=2,
                 temperature=1.0,
                 seed=5,
                 logprobs=0)
    for completion in output.outputs:
        records = training_records(output.prompt_token_ids,
                                   completion.promise_tree, hook_ids.child)
        assert len(records) == 4
        for record in records:
            # Context and tokens are exactly the sequence the engine ran.
            assert list(record.context_token_ids +
                        record.token_ids) == ran[record.request_id]
            assert len(record.logprobs) == len(record.token_ids)
            assert [lp is None for lp in record.logprobs
                    ] == [not sampled for sampled in record.sampled_mask]
        root, child = records[0], records[1]
        assert root.parent_id is None and child.parent_id == root.request_id
    assert_engine_clean(hooked_llm)


def test_an_aborted_child_is_recorded_without_results(hooked_llm, hook_ids):
    plans = {(): [NONE, hook_ids.promise, NONE], (0, ): [NONE] * 30}
    [child] = run(hooked_llm, plans, hook_ids).promise_tree.children
    assert child.finish_reason == "abort" and child.token_ids == ()
    assert_engine_clean(hooked_llm)
