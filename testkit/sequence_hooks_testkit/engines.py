# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The test engines (the tiny model on the V0 engine, fp32, eager), how
programs run on them, and the checks every run ends with."""

from pathlib import Path

from sequence_hooks_testkit import conformance
from sequence_hooks_testkit.conformance import Flavour
from sequence_hooks_testkit.oracle import scripted_params
from sequence_hooks_testkit.programs import Program
from sequence_hooks_testkit.tiny_model import HookIds


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


def run_hooked(llm,
               ids: HookIds,
               prompts,
               program_list: list[Program],
               max_tokens: int = 64):
    """Runs one program per prompt on a hooked engine, greedy.

    Args:
        llm: A hooked `LLM`.
        ids: The tiny tokenizer's hook token ids.
        prompts: The prompts.
        program_list: The program of each prompt.
        max_tokens: Each request's budget.

    Returns:
        The `RequestOutput`s, in prompt order.
    """
    return conformance.run_hooked(V0, llm, ids, prompts, program_list,
                                  max_tokens)


def assert_engine_clean(llm) -> None:
    """Nothing left behind: no request, parked group, registered child or
    used KV block."""
    engine = llm.llm_engine
    scheduler = engine.scheduler[0]
    block_manager = scheduler.block_manager
    assert not engine.has_unfinished_requests()
    assert not scheduler.parked
    assert engine.seq_id_to_seq_group == {}
    assert (block_manager.get_num_free_gpu_blocks() ==
            block_manager.num_total_gpu_blocks)


# The checks of `conformance` on the V0 engine.
V0 = Flavour(scripted_params=scripted_params,
             promise_tree=lambda output: output.promise_tree,
             sample_tree=lambda output, completion: completion.promise_tree,
             assert_engine_clean=assert_engine_clean)
