# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`PromiseTreeGRPOTrainer`: TRL's `GRPOTrainer` with its colocated
engine hooked and every node of its promise-tree rollouts trained.

- what is trained: each node's own sampled tokens (hook tokens included:
  `<promise>` and `<sync>` are the policy's actions), in the context it
  sampled them in: the root after the prompt; a child after its parent's
  context, the parent's tokens up to its `<promise>` and the role marker
  (`sequence_hooks.training_records`), not where its text was merged;
- merged tokens are context, never actions: `env_mask` 0 wherever a merge
  appended them (the engine gives them logprob 0.0, never sampled);
- credit: the reward scores the root's final text; every node of a tree
  gets its root's advantage (GRPO's group baseline over the roots of one
  prompt), so a child that wrote the sentence the conclusion used shares
  the conclusion's credit. ``train_children=False`` leaves the children's
  rows out (roots only, their merged tokens still masked): the control
  that tells what training the children adds.

TRL's batch holds one row per prompt; the trainer adds one row per child
after TRL built the roots' rows (`_generate`), so TRL's own code computes
every row's logprobs, reference logprobs, importance-sampling ratio and
masks, and only the advantage is copied from the root
(`_generate_and_score_completions`).
"""

import logging
from typing import Any, Optional

import torch
import trl
from trl import GRPOTrainer
from vllm_sequence_hooks_rl.rollout import (CHILDREN_KEY, hooked_trl_engine,
                                            node_row, tree_rollout)
from vllm_sequence_hooks_rl.settings import (SMALL_REWARD_SPREAD, check_config,
                                             scales_advantages,
                                             small_spread_groups)
from vllm_sequence_hooks_rl.trl_seams import SUPPORTED_TRL_VERSIONS

from sequence_hooks.training_records import SequenceRecord

# Not under "vllm": TRL's colocated engine sets that logger to ERROR, which
# would silence the warning below.
logger = logging.getLogger(__name__)


def _refresh_tied_output_layer(worker: Any) -> None:
    """Re-processes an output layer tied to the input embedding, in a
    worker, after `reload_weights`.

    vLLM's reload processes each layer whose weights it loaded; a tied
    output layer loads none of its own (the embedding's are its), so it
    keeps what it made from the old weights: on CPU the linear kernel's
    packed copy of them (measured: a 5 % change of the embedding left the
    engine's logprobs 0.5 off the trainer's; re-processed, 3e-5). Elsewhere
    this processing does nothing.
    """
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    if head is not None and getattr(model.config, "tie_word_embeddings",
                                    False):
        head.quant_method.process_weights_after_loading(head)


class PromiseTreeGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` that trains every node of its promise-tree rollouts.

    Its colocated engine is hooked (`hooked_trl_engine`) and its rollouts
    are `tree_rollout`'s. Each child becomes a row of its own after the
    roots' rows, in its own context, with its root's advantage.

    Args:
        special_kwargs: The hooks' configuration.
        train_children: Whether children's rows are trained; False
            trains the roots' rows only (the trees are sampled the same).
        *args: `GRPOTrainer`'s; its ``model`` loaded (not a name), its
            ``args`` with ``use_vllm=True``, ``vllm_mode="colocate"``, a
            loss in `TOKEN_NORMALIZED_LOSSES`, no sleep mode, no tensor
            parallelism, and no reward weighted at most
            `AUXILIARY_WEIGHT_RATIO` of the largest under advantages
            scaled by a standard deviation (`settings.check_config`).
        **kwargs: `GRPOTrainer`'s; ``rollout_func`` defaults to
            `tree_rollout`.
    """

    def __init__(self,
                 *args: Any,
                 special_kwargs: Any,
                 train_children: bool = True,
                 **kwargs: Any) -> None:
        if trl.__version__ not in SUPPORTED_TRL_VERSIONS:
            raise RuntimeError(
                f"vllm_sequence_hooks_rl supports TRL "
                f"{', '.join(SUPPORTED_TRL_VERSIONS)}, not the installed "
                f"{trl.__version__}: it overrides private members of "
                "GRPOTrainer (TRL_SEAMS)")
        model = kwargs.get("model", args[0] if args else None)
        check_config(model, kwargs.get("args"))
        kwargs.setdefault("rollout_func", tree_rollout)
        self.train_children = train_children
        # Per generation batch: for each row, the root row it belongs to.
        self._row_roots: Optional[torch.Tensor] = None
        # The engine samples from the model being trained, in its dtype.
        with hooked_trl_engine(special_kwargs, dtype=model.dtype):
            super().__init__(*args, **kwargs)

    def _sync_engine_weights(self) -> None:
        """Loads the trainer's weights into the colocated engine.

        TRL's own sync loads each tensor with the model's `load_weights`,
        which vLLM's CPU backend cannot take after start (it repacks
        linear weights for its GEMM kernels and drops the parameters'
        loaders); vLLM's `reload_weights` reloads them all and repacks
        again, on every platform.
        """
        llm = self.vllm_generation.llm
        # TRL's iterator itself, consumed in this process (the colocated
        # engine's executor runs here): a tensor it yields is valid only
        # while it holds it (PEFT merges the adapters for the iteration,
        # ZeRO-3 and FSDP gather one parameter at a time), and the model
        # is not copied.
        llm.collective_rpc("reload_weights",
                           kwargs={
                               "weights_iterator":
                               self.vllm_generation._iter_named_params()
                           })
        llm.collective_rpc(_refresh_tied_output_layer)
        if not llm.reset_prefix_cache():
            raise RuntimeError("the engine kept its prefix cache after a "
                               "weight sync: its cached KV is the old "
                               "weights'")

    def _generate(self, prompts: list):
        if self.state.global_step != self._last_loaded_step:
            self._sync_engine_weights()
            # TRL's `_generate` syncs only when this differs.
            self._last_loaded_step = self.state.global_step
        (prompt_ids, completion_ids, tool_mask, completions, logprobs,
         extra_fields, images, tool_images) = super()._generate(prompts)
        children = extra_fields.pop(CHILDREN_KEY, [[]] * len(prompt_ids))
        roots = list(range(len(prompt_ids)))
        if tool_mask is None:
            tool_mask = [[1] * len(ids) for ids in completion_ids]
        # A child aborted (its parent ended without syncing it) has no
        # tokens recorded: nothing of it to train.
        children = [[r for r in records if r.token_ids]
                    for records in children]
        for root, records in enumerate(children):
            for record in records if self.train_children else ():
                ids, record_logprobs, mask = node_row(record)
                prompt_ids.append(list(record.context_token_ids))
                completion_ids.append(ids)
                logprobs.append(record_logprobs)
                tool_mask.append(mask)
                roots.append(root)
        # TRL splits a generation batch into `steps_per_generation` equal
        # parts and drops a remainder: pad with rows that train nothing.
        while len(roots) % self.args.steps_per_generation:
            prompt_ids.append(prompt_ids[0])
            completion_ids.append(completion_ids[0][:1])
            logprobs.append(logprobs[0][:1])
            tool_mask.append([0])
            roots.append(-1)
        self._row_roots = torch.tensor(roots)
        self._log_trees(children, tool_mask, roots)
        return (prompt_ids, completion_ids, tool_mask, completions, logprobs,
                extra_fields, images, tool_images)

    def _log_trees(self, children: list[list[SequenceRecord]],
                   masks: list[list[int]], roots: list[int]) -> None:
        """Logs a generation batch's trees with TRL's metrics: trees,
        children (trained or not), trained tokens and merged tokens
        masked out in the rows trained."""
        metrics = self._metrics["train" if self.model.training else "eval"]
        real = [mask for mask, root in zip(masks, roots) if root >= 0]
        metrics["promise_tree/trees"].append(len(children))
        metrics["promise_tree/children"].append(sum(map(len, children)))
        metrics["promise_tree/trained_tokens"].append(sum(map(sum, real)))
        metrics["promise_tree/merged_tokens"].append(
            sum(len(mask) - sum(mask) for mask in real))

    def _calculate_rewards(self, inputs, prompts, completions,
                           completion_ids_list):
        # Rewards score the roots (the rows TRL made, one per prompt).
        rewards = super()._calculate_rewards(
            inputs, prompts, completions, completion_ids_list[:len(prompts)])
        generations = (self.num_generations
                       if self.model.training else self.num_generations_eval)
        if scales_advantages(self.args) and generations > 1:
            summed = (rewards *
                      self.reward_weights.to(rewards.device)).nansum(dim=1)
            small = small_spread_groups(summed, generations)
            if small:
                logger.warning(
                    "step %d: %d group(s) of rewards spread below %s and "
                    "their advantages are divided by that spread (scale_"
                    "rewards=%r): unit-size advantages from a small "
                    "auxiliary reward or noise; use scale_rewards='none'",
                    self.state.global_step, small, SMALL_REWARD_SPREAD,
                    self.args.scale_rewards)
        return rewards

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        roots = self._row_roots.to(output["advantages"].device)
        advantages = output["advantages"][roots.clamp(min=0)]
        output["advantages"] = torch.where(roots >= 0, advantages,
                                           torch.zeros_like(advantages))
        return output
