# SPDX-License-Identifier: Apache-2.0
"""The test engines: the tiny model on the V0 engine, fp32, eager."""

from pathlib import Path


def tiny_llm(model_path: Path,
             hook_ids=None,
             role_marker: bool = True,
             **engine_kwargs):
    """An `LLM` over the tiny model, with sequence hooks if ids are given.

    fp32, because this CPU's default bf16 flips greedy choices between
    batch compositions and the oracles compare tokens exactly.

    Args:
        model_path: The tiny model's folder.
        hook_ids: `HookIds` to turn the hooks on; None for a stock engine.
        role_marker: Whether children get the `<child>` marker.
        engine_kwargs: Overrides of the engine arguments.
    """
    from vllm import LLM
    from vllm.config import SpecialKwargs
    if hook_ids is not None:
        engine_kwargs["special_kwargs"] = SpecialKwargs(
            sync_token_id=hook_ids.sync,
            promise_token_id=hook_ids.promise,
            child_role_token_id=hook_ids.child if role_marker else None)
    return LLM(model=str(model_path),
               **{
                   "max_model_len": 256,
                   "enforce_eager": True,
                   "dtype": "float32",
                   "seed": 0,
                   **engine_kwargs
               })


def engine_config(model_path: Path, **engine_kwargs):
    """The engine configuration `EngineArgs` builds for the tiny model,
    which is where bad hook configurations are refused.

    Args:
        model_path: The tiny model's folder.
        engine_kwargs: Further engine arguments.

    Returns:
        The `VllmConfig`.
    """
    from vllm.engine.arg_utils import EngineArgs
    return EngineArgs(model=str(model_path),
                      max_model_len=128,
                      **engine_kwargs).create_engine_config()
