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

The rows: by default each tree is one packed row (`packing`): the root's
row with every child's tokens after it, each token attending only to
what it was generated after, at its position in generation, so a parent's
context is computed once for all its children. TRL's batch keeps one row
per prompt; the forward passes (`_get_per_token_logps_and_entropies`) get
the tree's mask and positions, and a sequence-level importance-sampling
ratio is made per node, as per-node rows have it. ``packed=False`` gives
each child a row of its own after the roots' rows (`_generate`), with its
root's advantage copied (`_generate_and_score_completions`): the same
loss and gradients (`rl/tests/test_rl_packing.py`), at the cost of
every parent's context once per child.
"""

import logging
import math
from typing import Any, Optional

import torch
import trl
from trl import GRPOTrainer
from vllm_sequence_hooks_rl.packing import (fit, node_row, node_sums,
                                            pack_tree, pad_layouts,
                                            tree_attention)
from vllm_sequence_hooks_rl.rollout import (CHILDREN_KEY, hooked_trl_engine,
                                            tree_rollout)
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
    are `tree_rollout`'s. Every node is trained in its own context, with
    its root's advantage: a tree packed in one row, or each child in a
    row of its own.

    Args:
        special_kwargs: The hooks' configuration.
        train_children: Whether children's rows are trained; False
            trains the roots' rows only (the trees are sampled the same).
        packed: Each tree in one packed row (`packing`); False gives each
            child a row of its own (the same loss and gradients, at more
            compute).
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
                 packed: bool = True,
                 **kwargs: Any) -> None:
        if trl.__version__ not in SUPPORTED_TRL_VERSIONS:
            raise RuntimeError(
                f"vllm_sequence_hooks_rl supports TRL "
                f"{', '.join(SUPPORTED_TRL_VERSIONS)}, not the installed "
                f"{trl.__version__}: it overrides private members of "
                "GRPOTrainer (TRL_SEAMS)")
        model = kwargs.get("model", args[0] if args else None)
        check_config(model, kwargs.get("args"), packed)
        kwargs.setdefault("rollout_func", tree_rollout)
        self.train_children = train_children
        self.packed = packed
        # Per generation batch: for each row, the root row it belongs to,
        # and each root's own tokens (the rewards score those).
        self._row_roots: Optional[torch.Tensor] = None
        self._root_lengths: list[int] = []
        # The packed rows' layout (`packing`) the forward passes of the
        # batch being scored or trained use; None for per-node rows.
        self._layout: Optional[torch.Tensor] = None
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
        if tool_mask is None:
            tool_mask = [[1] * len(ids) for ids in completion_ids]
        # A child aborted (its parent ended without syncing it) has no
        # tokens recorded: nothing of it to train.
        children = [[r for r in records if r.token_ids]
                    for records in children]
        self._log_trees(tool_mask, children)
        self._root_lengths = [len(ids) for ids in completion_ids]
        self._row_roots = torch.arange(len(prompt_ids))
        self._layout = None
        if self.packed and self.train_children:
            trees = [
                pack_tree(len(prompt), row, records)
                for prompt, *row, records in zip(prompt_ids, completion_ids,
                                                 logprobs, tool_mask, children)
            ]
            completion_ids = [tree.completion_ids for tree in trees]
            logprobs = [tree.logprobs for tree in trees]
            tool_mask = [tree.mask for tree in trees]
            self._layout = pad_layouts([tree.prev for tree in trees])
        elif self.train_children:
            roots = self._node_rows(prompt_ids, completion_ids, logprobs,
                                    tool_mask, children)
            self._row_roots = torch.tensor(roots)
        return (prompt_ids, completion_ids, tool_mask, completions, logprobs,
                extra_fields, images, tool_images)

    def _node_rows(self, prompt_ids: list, completion_ids: list,
                   logprobs: list, tool_mask: list,
                   children: list[list[SequenceRecord]]) -> list[int]:
        """Appends each child's row after the roots' rows, in place.

        Returns:
            Per row, the root row it belongs to (-1 for the rows that
            train nothing, added so that TRL's split drops none).
        """
        roots = list(range(len(prompt_ids)))
        for root, records in enumerate(children):
            for record in records:
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
        return roots

    def _log_trees(self, root_masks: list[list[int]],
                   children: list[list[SequenceRecord]]) -> None:
        """Logs a generation batch's trees with TRL's metrics: trees,
        children (trained or not), trained tokens and merged tokens
        masked out in the nodes trained."""
        metrics = self._metrics["train" if self.model.training else "eval"]
        masks = [list(mask) for mask in root_masks]
        if self.train_children:
            masks += [r.sampled_mask for records in children for r in records]
        metrics["promise_tree/trees"].append(len(children))
        metrics["promise_tree/children"].append(sum(map(len, children)))
        metrics["promise_tree/trained_tokens"].append(sum(map(sum, masks)))
        metrics["promise_tree/merged_tokens"].append(
            sum(len(mask) - sum(mask) for mask in masks))

    def _calculate_rewards(self, inputs, prompts, completions,
                           completion_ids_list):
        # Rewards score the roots' own tokens (the rows TRL made, one per
        # prompt; a packed row's children come after its root's tokens).
        rewards = super()._calculate_rewards(inputs, prompts, completions, [
            ids[:length]
            for ids, length in zip(completion_ids_list, self._root_lengths)
        ])
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
        try:
            output = super()._generate_and_score_completions(inputs)
            layout = self._layout
        finally:
            self._layout = None
        roots = self._row_roots.to(output["advantages"].device)
        advantages = output["advantages"][roots.clamp(min=0)]
        output["advantages"] = torch.where(roots >= 0, advantages,
                                           torch.zeros_like(advantages))
        if layout is not None:
            layout = fit(layout, output["completion_ids"].size(1))
            output["tree_layout"] = layout.to(output["completion_ids"].device)
            ratio = output.get("importance_sampling_ratio")
            if ratio is not None and ratio.size(1) == 1:
                output["importance_sampling_ratio"] = self._per_node_ratio(
                    output, output["tree_layout"])
        return output

    def _per_node_ratio(self, output: dict,
                        layout: torch.Tensor) -> torch.Tensor:
        """TRL's sequence-level importance-sampling ratio (engine against
        trainer), made per node of a packed row, as a per-node row has it
        (TRL's would be the whole tree's).

        Args:
            output: The scored batch (`old_per_token_logps`,
                `sampling_per_token_logps`, the masks).
            layout: Its rows' layout.

        Returns:
            (rows, C): each token's node's ratio, truncated or masked as
            `vllm_importance_sampling_mode` says.
        """
        mask = output["completion_mask"] * output.get("tool_mask", 1)
        difference = torch.nan_to_num(
            (output["old_per_token_logps"] -
             output["sampling_per_token_logps"]) * mask,
            nan=0.0)
        ratio = torch.exp(node_sums(difference, layout))
        low = self.vllm_importance_sampling_clip_min
        high = self.vllm_importance_sampling_clip_max
        if self.vllm_importance_sampling_mode == "sequence_truncate":
            return torch.clamp(ratio, min=low, max=high)
        low = -math.inf if low is None else low
        high = math.inf if high is None else high
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)

    def _compute_loss(self, model, inputs):
        self._layout = inputs.get("tree_layout")
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._layout = None

    def _get_per_token_logps_and_entropies(self,
                                           model,
                                           input_ids,
                                           attention_mask,
                                           logits_to_keep,
                                           batch_size=None,
                                           compute_entropy=False,
                                           compute_aux_loss=False,
                                           **kwargs):
        if self._layout is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size,
                compute_entropy, compute_aux_loss, **kwargs)
        # TRL's forward (fused LM head: logprobs and entropies without the
        # full logits) with each packed row's tree mask and positions.
        layout = fit(self._layout, logits_to_keep)
        prompt_mask = attention_mask[:, :-logits_to_keep]
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            mask, positions = tree_attention(prompt_mask[rows].cpu(),
                                             layout[rows].cpu(), model.dtype)
            # Every completion token is scored (a head's score is never
            # trained: its mask is 0), the prompt and padding are not.
            labels = input_ids[rows].masked_fill(attention_mask[rows] == 0,
                                                 -100)
            labels[:, :-logits_to_keep] = -100
            with self.accelerator.autocast():
                outputs = model(input_ids=input_ids[rows],
                                attention_mask=mask.to(input_ids.device),
                                position_ids=positions.to(input_ids.device),
                                labels=labels,
                                fused_lm_head=True)
            logps.append(outputs.log_probs[:, -logits_to_keep:])
            if compute_entropy:
                entropies.append(outputs.entropy[:, -logits_to_keep:])
        return (torch.cat(logps),
                torch.cat(entropies) if compute_entropy else None, None)
