# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pipeline parallelism: one scheduler, several batches in flight.

V0 refused pipeline parallelism because each virtual engine had its own
scheduler. V1 has one, which the engine core's batch queue drives with
`max_concurrent_batches` batches in flight: the pipeline's depth (its
stages without async scheduling; stages + 1 with async scheduling, which
only Model Runner V2 runs under pipeline parallelism).

- On the engine: PP = 2 on V1's multiproc executor, two CPU stage
  processes, compiled (eager, vLLM 0.32's CPU model runner fails at the
  second stage's first step, hooks or not:
  `v1_run_programs`), in a subprocess: every conformance program
  matches the hook-free reference and the engine core is left clean.
- Model-free, at the depths a GPU deployment runs (`v1_batch_queue`):
  every request's tokens equal the one-batch run's, and nothing is left.
"""

import pytest
from vllm_sequence_hooks.scheduler import SequenceHookScheduler

from sequence_hooks_testkit.v1_batch_queue import (FILLER, BatchQueueDriver,
                                                   make_request,
                                                   make_scheduler)
from sequence_hooks_testkit.v1_run_programs import assert_programs_match
from vllm.config import ParallelConfig

PROMPT_LEN = 20


def test_programs_match_the_reference_with_two_pipeline_stages(
        tiny_model_path):
    assert_programs_match(
        tiny_model_path,
        "--pipeline-parallel-size",
        "2",
        timeout_s=1200,
        tensor_parallel_size=1,
        pipeline_parallel_size=2,
        # The engine core's batch queue: one batch per stage.
        batches_in_flight=2)


def tree_sampler(hook_ids):
    """Each root promises twice (the first child nested once), syncs and
    ends at its 16th token; each child writes four fillers and ends."""

    def sample(request_id: str, position: int) -> int:
        if "/promise-" in request_id:
            nested = request_id.endswith("-0") and request_id.count(
                "/promise-") == 1
            if nested and position == 1:
                return hook_ids.promise
            if nested and position == 2:
                return hook_ids.sync
            return hook_ids.eos if position >= 4 else FILLER
        if position in (1, 2):
            return hook_ids.promise
        if position == 3:
            return hook_ids.sync
        return hook_ids.eos if position >= 16 else FILLER

    return sample


def run(tiny_model_path, hook_ids, stages: int, async_scheduling: bool,
        depth: int):
    scheduler = make_scheduler(
        SequenceHookScheduler,
        tiny_model_path,
        async_scheduling, {
            "sync_token_id": hook_ids.sync,
            "promise_token_id": hook_ids.promise,
            "child_role_token_id": hook_ids.child,
        },
        parallel_config=ParallelConfig(pipeline_parallel_size=stages))
    assert scheduler.use_pp == (stages > 1)
    driver = BatchQueueDriver(scheduler, tree_sampler(hook_ids), depth=depth)
    for i in range(6):
        prompt = [FILLER + 1 + (i + j) % 5 for j in range(PROMPT_LEN)]
        driver.add(make_request(scheduler, f"r{i}", prompt, 64, hook_ids.eos))
        # Requests arrive while batches are in flight, as they do in
        # serving: the pipeline fills with new work.
        for _ in range(3):
            driver.step()
    driver.run()
    tokens: dict[str, list[int]] = {}
    for request_id, new_tokens, _ in driver.outputs:
        tokens.setdefault(request_id, []).extend(new_tokens)
    assert scheduler.requests == {}
    assert scheduler.hooks.coordinator.num_members() == 0
    assert scheduler.num_waiting_for_streaming_input == 0
    assert len(scheduler.hooks.members.sample_trees) == 0
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    return tokens, driver


@pytest.mark.parametrize("stages, async_scheduling, depth", [
    (2, False, 2),
    (4, False, 4),
    (2, True, 3),
],
                         ids=["pp2", "pp4", "pp2-async"])
def test_trees_at_pipeline_depth_equal_the_one_batch_run(
        tiny_model_path, hook_ids, stages, async_scheduling, depth):
    expected, _ = run(tiny_model_path, hook_ids, 1, False, 1)
    assert set(expected) == {f"r{i}" for i in range(6)}
    # Each root's output holds its sync's merged tokens.
    assert all(
        tokens.count(hook_ids.sync) == 1 for tokens in expected.values())
    tokens, driver = run(tiny_model_path, hook_ids, stages, async_scheduling,
                         depth)
    assert tokens == expected
    assert len(driver.trees) == 6
    # The queue filled: steps scheduled with others in flight.
    assert driver.overlapped > 0
