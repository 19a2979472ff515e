# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The V1 test engines (stock vLLM 0.32 with the plugin) and their checks.

Import only in the V1 environment (`.venv-v1`).
"""

from pathlib import Path


def v1_llm(model_path: Path, hook_ids=None, **engine_kwargs):
    """A V1 `LLM` over the tiny model (fp32, eager), hooked if ids given.

    Args:
        model_path: The tiny model's folder.
        hook_ids: `HookIds` to turn the hooks on (role marker included).
        engine_kwargs: Overrides of the engine arguments.
    """
    from vllm_sequence_hooks import hooked_engine_args

    from sequence_hooks_testkit.v1_scripted_logits import (RandomHooksV1,
                                                           ScriptedHooksV1)
    from vllm import LLM
    if hook_ids is not None:
        engine_kwargs.update(
            hooked_engine_args({
                "sync_token_id": hook_ids.sync,
                "promise_token_id": hook_ids.promise,
                "child_role_token_id": hook_ids.child,
            }))
    return LLM(model=str(model_path),
               **{
                   "max_model_len": 256,
                   "enforce_eager": True,
                   "dtype": "float32",
                   "seed": 0,
                   "logits_processors": [ScriptedHooksV1, RandomHooksV1],
                   **engine_kwargs
               })


def scheduler_of(llm):
    """The engine core's scheduler (in-process engine core)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def assert_engine_clean(llm):
    scheduler = scheduler_of(llm)
    pool = scheduler.kv_cache_manager.block_pool
    assert not llm.llm_engine.has_unfinished_requests()
    assert scheduler.requests == {}
    assert scheduler.nodes == {} and scheduler.trees == {}
    assert scheduler.pending_forks == {} and scheduler.budgets == {}
    assert scheduler.num_waiting_for_streaming_input == 0
    # Every block but the pool's reserved null block is free.
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
