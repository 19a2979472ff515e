# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sequence hooks with prefix caching on: children enter the prefix-cache
tracker when they fork, so freeing one before it was ever scheduled
(parent ends, abort, preemption) is safe; outputs match the oracle."""

import pytest

from sequence_hooks_testkit.engines import (assert_engine_clean, run_hooked,
                                            tiny_llm)
from sequence_hooks_testkit.oracle import reference, scripted
from sequence_hooks_testkit.programs import programs
from vllm import SamplingParams


@pytest.fixture(scope="module")
def prefix_llm(tiny_model_path, hook_ids):
    return tiny_llm(tiny_model_path,
                    hook_ids,
                    enable_prefix_caching=True,
                    block_size=16)


def test_programs_match_the_oracle(prefix_llm, plain_llm, hook_ids):
    named = programs(hook_ids)
    prompt = " ".join(["the cat sees the dog"] * 5)  # full, shared blocks
    outputs = run_hooked(prefix_llm, hook_ids, [prompt] * len(named),
                         list(named.values()))
    for output, plans in zip(outputs, named.values()):
        expected = reference(plain_llm, hook_ids, plans,
                             output.prompt_token_ids)
        assert list(output.outputs[0].token_ids) == expected.token_ids
    assert_engine_clean(prefix_llm)


def test_children_freed_before_their_first_step(prefix_llm, hook_ids):
    # The parent ends in the step after its promise: its child is freed
    # before it ever ran.
    plans = {(): [None, hook_ids.promise], (0, ): [None] * 30}
    [output] = run_hooked(prefix_llm, hook_ids, ["the cat sees"], [plans])
    assert output.promise_tree.children[0].finish_reason == "abort"
    # An abort right after the promise does the same.
    engine = prefix_llm.llm_engine
    engine.add_request(
        "abort-early", "the cat sees",
        SamplingParams(temperature=0.0,
                       max_tokens=32,
                       logits_processors=[scripted(plans, hook_ids)]))
    engine.step()
    engine.step()
    assert engine.seq_id_to_seq_group
    engine.abort_request("abort-early")
    engine.step()
    assert_engine_clean(prefix_llm)
