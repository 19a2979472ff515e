# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hooks without a role marker: a child's context is exactly its parent's.

Without the marker a child's first step is a plain decode of its
`<promise>`: one token, nothing recomputed. The scripted processor cannot
tell a child from its parent here, so a child simply goes on with its
parent's plan from the promise on.
"""

import pytest

from sequence_hooks_testkit.engines import tiny_llm
from sequence_hooks_testkit.oracle import scripted
from vllm import SamplingParams

NONE = None


@pytest.fixture(scope="module")
def unmarked_llm(tiny_model_path, hook_ids):
    return tiny_llm(tiny_model_path,
                    hook_ids,
                    role_marker=False,
                    disable_log_stats=False)


def plans(ids):
    # The child starts at step 2: two free tokens, an ordinary <sync>, one
    # more, EOS. The parent waits for it at its own <sync>.
    return {(): [NONE, ids.promise, NONE, NONE, ids.sync, NONE]}


def generate(llm, ids, **params):
    [output] = llm.generate(["the cat sees"],
                            SamplingParams(
                                max_tokens=32,
                                logits_processors=[scripted(plans(ids), ids)],
                                **params),
                            use_tqdm=False)
    return output


def test_child_first_step_computes_one_token(unmarked_llm, hook_ids,
                                             monkeypatch):
    scheduler = unmarked_llm.llm_engine.scheduler[0]
    schedule = scheduler.schedule
    chunks = []

    def recording_schedule():
        metadata, outputs, allow_async = schedule()
        chunks.extend((m.request_id, g.token_chunk_size, m.is_prompt)
                      for m, g in zip(metadata, outputs.scheduled_seq_groups))
        return metadata, outputs, allow_async

    monkeypatch.setattr(scheduler, "schedule", recording_schedule)
    output = generate(unmarked_llm, hook_ids, temperature=0.0)
    [child] = output.promise_tree.children
    assert child.finish_reason == "stop" and child.text.strip()
    child_chunks = [(n, p) for rid, n, p in chunks if rid == child.request_id]
    assert child_chunks[0] == (1, False)
    block_manager = scheduler.block_manager
    assert (block_manager.get_num_free_gpu_blocks() ==
            block_manager.num_total_gpu_blocks)


def test_seeded_request_with_children_is_reproducible(unmarked_llm, hook_ids):
    first = generate(unmarked_llm, hook_ids, temperature=1.0, seed=7)
    again = generate(unmarked_llm, hook_ids, temperature=1.0, seed=7)
    assert first.outputs[0].token_ids == again.outputs[0].token_ids
    [child] = first.promise_tree.children
    assert child.token_ids == again.promise_tree.children[0].token_ids
    assert not unmarked_llm.llm_engine.has_unfinished_requests()
