# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV blocks scarce while a parent is parked at `<sync>`: with prefix
caching on, the parked parent gives its blocks back before a running child
is preempted, and its resume gets its full blocks back as prefix-cache
hits; without prefix caching the child is preempted as before.

The tiny model on the real engine, a cache of 5 blocks of 16 tokens. The
parent parks with 19 computed tokens (one full block of its own, one
partial); its child then needs a fourth block while the parent holds two.
"""

import pytest

from sequence_hooks_testkit.engines import (assert_engine_clean, run_hooked,
                                            tiny_llm)
from sequence_hooks_testkit.oracle import scripted
from sequence_hooks_testkit.schedule_recorder import ScheduleRecorder
from vllm import SamplingParams

BLOCK_SIZE = 16
NUM_BLOCKS = 5
PROMPT = "the cat sees the dog"
MAX_STEPS = 500


def program(ids):
    """A parent that syncs 15 tokens after its prompt, a long child."""
    return {
        (): [None, ids.promise] + [None] * 12 + [ids.sync] + [None] * 3,
        (0, ): [None] * 40,
    }


def small_cache_llm(model_path, ids, prefix_caching: bool):
    return tiny_llm(model_path,
                    ids,
                    enable_prefix_caching=prefix_caching,
                    block_size=BLOCK_SIZE,
                    num_gpu_blocks_override=NUM_BLOCKS,
                    max_model_len=BLOCK_SIZE * NUM_BLOCKS)


def params(ids, **sampling):
    """The program's SamplingParams: greedy unless ``sampling`` says."""
    return SamplingParams(
        **{
            "temperature": 0.0,
            "max_tokens": 64,
            "logits_processors": [scripted(program(ids), ids)],
            **sampling
        })


def run(llm, ids, **sampling):
    """Runs the program as request "tree", recording every step.

    Args:
        llm: The engine.
        ids: The tiny tokenizer's hook token ids.
        sampling: SamplingParams fields other than the program's.

    Returns:
        The finished output, the recorder, the preemptions during the run,
        and per step whether the parent was parked without any block.
    """
    engine = llm.llm_engine
    scheduler = engine.scheduler[0]
    preemptions = scheduler.num_cumulative_preemption
    parked_without_blocks = []

    def observe(outputs) -> None:
        parent = scheduler.parked.get("tree")
        parked_without_blocks.append(
            parent is not None and parent.first_seq.seq_id
            not in scheduler.block_manager.block_tables)

    engine.add_request("tree", PROMPT, params(ids, **sampling))
    finished = None
    with ScheduleRecorder(scheduler, observe) as recorder:
        for _ in range(MAX_STEPS):
            if not engine.has_unfinished_requests():
                break
            for output in engine.step():
                if output.finished:
                    finished = output
        else:
            raise AssertionError(f"not finished after {MAX_STEPS} steps")
    engine.step()  # the engine forgets finished ids at its next step
    assert_engine_clean(llm)
    return (finished, recorder,
            scheduler.num_cumulative_preemption - preemptions,
            parked_without_blocks)


@pytest.fixture(scope="module")
def roomy_output(hooked_llm, hook_ids):
    [output] = run_hooked(hooked_llm, hook_ids, [PROMPT], [program(hook_ids)])
    return output


@pytest.fixture(scope="module")
def prefix_llm(tiny_model_path, hook_ids):
    return small_cache_llm(tiny_model_path, hook_ids, prefix_caching=True)


def test_parked_parent_frees_its_blocks_and_resumes_from_the_cache(
        prefix_llm, hook_ids, roomy_output):
    output, recorder, preemptions, parked_without_blocks = run(
        prefix_llm, hook_ids)
    # The parent's blocks went back instead of a running sequence.
    assert preemptions == 0
    assert any(parked_without_blocks)
    # Its resume is one prefill over its whole context, of which the cache
    # held the full block the parent computed before it parked (19 tokens);
    # the model computes only the rest.
    parked_at = recorder.steps.index(
        next(step for step in recorder.steps if "tree" in step.parked))
    parent_chunks = [
        chunk for step in recorder.steps[parked_at:] for chunk in step.chunks
        if chunk.request_id == "tree"
    ]
    resume = parent_chunks[0]
    assert resume.is_prompt and resume.num_computed_before == 0
    assert resume.num_cached_tokens == BLOCK_SIZE
    # Each of its steps from the resume on sampled one token.
    assert resume.num_tokens == len(output.prompt_token_ids) + len(
        output.outputs[0].token_ids) - len(parent_chunks)
    assert not any(chunk.is_prompt for chunk in parent_chunks[1:])
    # The cached KV is the parent's own: the outputs are those of a roomy
    # engine.
    assert output.outputs[0].token_ids == roomy_output.outputs[0].token_ids
    assert [c.token_ids for c in output.promise_tree.children
            ] == [c.token_ids for c in roomy_output.promise_tree.children]


def test_without_prefix_caching_the_child_is_preempted_as_before(
        tiny_model_path, hook_ids, roomy_output):
    llm = small_cache_llm(tiny_model_path, hook_ids, prefix_caching=False)
    output, _, preemptions, parked_without_blocks = run(llm, hook_ids)
    # An eviction would recompute the parent's whole context: the parent
    # keeps its blocks while its child runs at all.
    assert preemptions > 0
    assert not any(parked_without_blocks)
    assert output.outputs[0].token_ids == roomy_output.outputs[0].token_ids


def test_an_evicted_seeded_parent_samples_as_without_pressure(
        prefix_llm, hooked_llm, hook_ids, roomy_output):
    # A resume with merged tokens is a prefill, which re-creates the
    # generator from the derived seed, evicted or not.
    sampling = dict(temperature=1.0, seed=7)
    output, _, _, parked_without_blocks = run(prefix_llm, hook_ids, **sampling)
    assert any(parked_without_blocks)
    [roomy] = hooked_llm.generate([PROMPT],
                                  params(hook_ids, **sampling),
                                  use_tqdm=False)
    assert output.outputs[0].token_ids == roomy.outputs[0].token_ids
    assert [c.token_ids for c in output.promise_tree.children
            ] == [c.token_ids for c in roomy.promise_tree.children]
    # Sampled, not greedy.
    assert output.outputs[0].token_ids != roomy_output.outputs[0].token_ids
