# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Promise-tree rollouts for TRL: the hooked colocated engine and the
trees it samples, flattened into TRL's one-row-per-completion shape.

`tree_rollout` is a TRL `rollout_func`: it runs each prompt through the
hooked V1 engine that the trainer colocates (in process) and returns each
tree's root as the row, its merged tokens masked (`env_mask` 0: the
engine never sampled them, so they are context, never actions), its other
nodes alongside as `SequenceRecord`s for the trainer to train.
"""

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import torch
import trl.generation.vllm_generation as trl_vllm_generation
from trl import GRPOTrainer
from vllm_sequence_hooks.config import hooked_engine_args, special_kwargs_of
from vllm_sequence_hooks.outputs import promise_tree
from vllm_sequence_hooks_rl.packing import node_row

from sequence_hooks import PromiseNode, SpecialKwargs
from sequence_hooks.training_records import SequenceRecord, training_records
from vllm.sampling_params import SamplingParams

# Extra fields of `tree_rollout`'s output, per root row: its tree's other
# nodes as `SequenceRecord`s (parents first), which the trainer turns into
# rows; its tree (`PromiseNode`), which reward functions get.
CHILDREN_KEY = "promise_children"
TREE_KEY = "promise_tree"


def _special_kwargs(llm: Any) -> SpecialKwargs:
    """The hooked engine's configuration, token strings resolved."""
    return special_kwargs_of(llm.llm_engine.vllm_config).resolve(
        llm.get_tokenizer())


def _prompt_ids(trainer: GRPOTrainer, prompt: Any) -> list[int]:
    """A prompt as token ids: chat-templated if it is a list of messages
    (TRL hands rollout functions the dataset's prompts untouched)."""
    tokenizer = trainer.processing_class
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return tokenizer.apply_chat_template(prompt,
                                         add_generation_prompt=True,
                                         tokenize=True,
                                         return_dict=False,
                                         **trainer.chat_template_kwargs)


def _sampling_params(trainer: GRPOTrainer) -> SamplingParams:
    """The trainer's generation settings, one sample per prompt row (TRL
    repeats each prompt `num_generations` times), sampled tokens'
    logprobs on."""
    return SamplingParams(n=1,
                          temperature=trainer.temperature,
                          top_p=trainer.top_p,
                          top_k=trainer.top_k or -1,
                          min_p=trainer.min_p or 0.0,
                          repetition_penalty=trainer.repetition_penalty,
                          max_tokens=trainer.max_completion_length,
                          logprobs=0)


def _root_record(output) -> SequenceRecord:
    """The record of a request that never promised: its one sequence."""
    completion = output.outputs[0]
    return SequenceRecord(
        output.request_id, None, tuple(output.prompt_token_ids),
        tuple(completion.token_ids), (True, ) * len(completion.token_ids),
        tuple(entry[token].logprob for token, entry in zip(
            completion.token_ids, completion.logprobs)),
        completion.finish_reason)


def run_trees(
    llm: Any, prompts_ids: list[list[int]], params: SamplingParams
) -> list[tuple[Optional[PromiseNode], list[SequenceRecord]]]:
    """Runs prompts through a hooked engine and flattens each tree.

    Args:
        llm: A `vllm.LLM` made with `hooked_engine_args`.
        prompts_ids: The prompts, as token ids.
        params: Sampling parameters with `logprobs=0` (or more) and n = 1.

    Returns:
        Per prompt, its tree (None if it never promised) and its records,
        root first, parents before their children (`training_records`).
    """
    role_marker = _special_kwargs(llm).child_role_token_id
    outputs = llm.generate([{
        "prompt_token_ids": ids
    } for ids in prompts_ids],
                           params,
                           use_tqdm=False)
    trees = []
    for output in outputs:
        tree = promise_tree(output)
        trees.append(
            (tree, [_root_record(output)] if tree is None else
             training_records(output.prompt_token_ids, tree, role_marker)))
    return trees


def tree_rollout(prompts: list[Any], trainer: GRPOTrainer) -> dict:
    """A TRL `rollout_func`: one promise tree per prompt row.

    Runs on the trainer's colocated engine, which must be hooked
    (`PromiseTreeGRPOTrainer`, or `GRPOTrainer` inside
    `hooked_trl_engine`). With plain `GRPOTrainer` only the roots' rows
    are trained (the children go to the reward functions as
    ``promise_children``), and the weights reach the engine by TRL's own
    sync, which vLLM's CPU backend refuses (`PromiseTreeGRPOTrainer`'s
    does not).

    Args:
        prompts: The trainer's prompt rows (text or chat messages).
        trainer: The trainer, `use_vllm=True`, `vllm_mode="colocate"`.

    Returns:
        ``prompt_ids``, ``completion_ids`` (the root's own tokens and its
        merged ones), ``logprobs`` (0.0 for merged tokens), ``env_mask``
        (1 sampled, 0 merged), ``promise_tree`` (per row, its tree's
        root `PromiseNode`, None if it never promised; reward functions
        get it) and ``promise_children`` (per row, the tree's other nodes
        as `SequenceRecord`s).
    """
    llm = trainer.vllm_generation.llm
    prompts_ids = [_prompt_ids(trainer, prompt) for prompt in prompts]
    trees = run_trees(llm, prompts_ids, _sampling_params(trainer))
    rollout: dict[str, list] = {
        "prompt_ids": prompts_ids,
        "completion_ids": [],
        "logprobs": [],
        "env_mask": [],
        TREE_KEY: [tree for tree, _ in trees],
        CHILDREN_KEY: [],
    }
    for _, records in trees:
        ids, logprobs, mask = node_row(records[0])
        rollout["completion_ids"].append(ids)
        rollout["logprobs"].append(logprobs)
        rollout["env_mask"].append(mask)
        rollout[CHILDREN_KEY].append(records[1:])
    return rollout


@contextlib.contextmanager
def hooked_trl_engine(special_kwargs: Any,
                      max_tree_size: Optional[int] = None,
                      dtype: Optional[torch.dtype] = None) -> Iterator[None]:
    """Makes the `LLM` that TRL colocates a hooked one, while in effect.

    Seam (TRL 1.16 `trl.generation.vllm_generation`, which builds its
    colocated engine with `LLM(...)` and takes no engine arguments of the
    caller's): the module's `LLM` name is swapped for a factory that adds
    `hooked_engine_args` to TRL's own arguments and makes room for the
    trees (TRL sizes `max_num_seqs` for one sequence per prompt row).
    Removable when TRL takes extra engine arguments.

    Args:
        special_kwargs: The hooks' configuration (a SpecialKwargs, a dict
            or its JSON).
        max_tree_size: Sequences per tree to make room for; default
            ``1 + max_children_per_request``.
        dtype: The engine's dtype; None leaves vLLM's choice (which
            downcasts an fp32 checkpoint to bf16 on CPU and fp16/bf16 on
            GPUs, so the engine would sample from another model than the
            one trained).

    Yields:
        Nothing: TRL's trainer is built inside the block.
    """
    hooked_args = hooked_engine_args(special_kwargs)
    parsed = SpecialKwargs.parse(special_kwargs)
    tree_size = max_tree_size or 1 + parsed.max_children_per_request

    stock = trl_vllm_generation.LLM

    def hooked_llm(**engine_args: Any) -> Any:
        if engine_args.get("max_num_seqs"):
            engine_args["max_num_seqs"] *= tree_size
        if dtype is not None:
            engine_args["dtype"] = dtype
        return stock(**engine_args, **hooked_args)

    trl_vllm_generation.LLM = hooked_llm
    try:
        yield
    finally:
        trl_vllm_generation.LLM = stock
