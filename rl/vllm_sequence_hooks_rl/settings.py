# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What `PromiseTreeGRPOTrainer` refuses to train, and the rewards it
warns about.

Every node of a tree is trained with its root's advantage, so the loss
must weigh a node by its tokens: only losses normalized by the batch's
trained tokens are accepted. Advantages divided by a reward's standard
deviation (TRL's default ``scale_rewards="group"``) turn the differences
of a small auxiliary reward (a bonus for a shorter critical path, say)
into unit-size advantages whenever a group ties on the main reward: a
reward function weighted far below the largest is refused with scaling
on, and a group whose rewards spread less than `SMALL_REWARD_SPREAD` is
counted for a warning at every step it is scaled.
"""

from typing import Any, Optional

import torch
import trl

# GRPO losses that normalize by the trained tokens of the whole generation
# batch (`num_items_in_batch`): under them a child's row weighs by its
# tokens, as the root's do, and rows that train nothing (the fillers
# `_generate` adds) weigh nothing. Per-row or per-micro-batch means
# ("grpo", "sapo", "bnpo", "dr_grpo", "luspo") would count every child row
# as much as a whole root row and the fillers as rows.
TOKEN_NORMALIZED_LOSSES = ("dapo", "cispo", "vespo")

# With advantages divided by a standard deviation, a reward function
# weighted at most this share of the largest weight is refused: its small
# differences would be scaled to unit size when the others tie.
AUXILIARY_WEIGHT_RATIO = 0.25
# A group whose summed rewards spread less than this (standard deviation,
# but not 0) is warned about when its advantages are scaled: the spread is
# an auxiliary reward's or noise, not the main reward's (a capital of 8
# differing in one of 4 samples spreads 0.0625).
SMALL_REWARD_SPREAD = 0.02


def scales_advantages(config: trl.GRPOConfig) -> bool:
    """Whether TRL divides the advantages (or a reward) by a standard
    deviation under ``config``."""
    return (config.scale_rewards != "none"
            or config.multi_objective_aggregation == "normalize_then_sum")


def small_spread_groups(rewards: torch.Tensor,
                        num_generations: int,
                        threshold: float = SMALL_REWARD_SPREAD) -> int:
    """Counts the groups whose rewards differ, but by little.

    Args:
        rewards: One summed reward per completion, a prompt's
            ``num_generations`` completions next to each other.
        num_generations: Completions per prompt.
        threshold: The standard deviation below which a spread is small.

    Returns:
        Groups whose standard deviation (TRL's, unbiased) is above 0 and
        below ``threshold``.
    """
    spread = rewards.view(-1, num_generations).std(dim=1)
    return int(((spread > 0) & (spread < threshold)).sum())


def check_config(model: Any,
                 config: Optional[trl.GRPOConfig],
                 packed: bool = True) -> None:
    """Refuses, before TRL builds anything, what `PromiseTreeGRPOTrainer`
    cannot train right.

    Args:
        model: The model passed to the trainer.
        config: Its `GRPOConfig`.
        packed: Whether trees are trained as packed rows.

    Raises:
        ValueError: Naming the setting and why.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError("PromiseTreeGRPOTrainer takes the model loaded (a "
                         "PreTrainedModel), not a name: its engine is "
                         "built in the model's dtype, so that it samples "
                         "from the model trained")
    if config is None or not config.use_vllm or (config.vllm_mode
                                                 != "colocate"):
        raise ValueError("PromiseTreeGRPOTrainer generates on a colocated "
                         "hooked engine: pass a GRPOConfig with "
                         "use_vllm=True, vllm_mode='colocate'")
    if config.vllm_enable_sleep_mode:
        raise ValueError("PromiseTreeGRPOTrainer does not support "
                         "vllm_enable_sleep_mode: it loads the weights "
                         "itself and would not wake the engine")
    if config.vllm_tensor_parallel_size > 1:
        raise ValueError("PromiseTreeGRPOTrainer does not support "
                         "vllm_tensor_parallel_size > 1: its rollouts do "
                         "not gather the prompts of a tensor-parallel group")
    if config.loss_type not in TOKEN_NORMALIZED_LOSSES:
        raise ValueError(
            f"PromiseTreeGRPOTrainer needs a loss normalized by the batch's "
            f"trained tokens ({', '.join(TOKEN_NORMALIZED_LOSSES)}), not "
            f"{config.loss_type!r}: a per-row mean would weigh each child's "
            "row as much as a whole root's")
    # A penalty weighs by its size; a weight of 0 turns its function off.
    sizes = [abs(w) for w in config.reward_weights or [] if w]
    if (scales_advantages(config) and len(sizes) > 1
            and min(sizes) <= AUXILIARY_WEIGHT_RATIO * max(sizes)):
        raise ValueError(
            f"PromiseTreeGRPOTrainer refuses reward_weights "
            f"{config.reward_weights} with "
            f"scale_rewards={config.scale_rewards!r} (multi_objective_"
            f"aggregation={config.multi_objective_aggregation!r}): "
            "advantages divided by a standard deviation turn the small "
            "weighted reward's differences into unit-size advantages "
            "whenever a group ties on the others; pass "
            "scale_rewards='none' with 'sum_then_normalize'")
    # What TRL computes per row (a row is a whole tree when packed), beyond
    # the sequence-level vLLM importance-sampling ratio the trainer makes
    # per node.
    per_row = {
        "loss_type='vespo'":
        config.loss_type == "vespo",
        "importance_sampling_level='sequence'":
        config.importance_sampling_level == "sequence",
        "off_policy_mask_threshold":
        config.off_policy_mask_threshold is not None,
        "mask_truncated_completions":
        config.mask_truncated_completions,
        "a router's auxiliary loss (output_router_logits)":
        getattr(model.config, "output_router_logits", False),
    }
    if packed and any(per_row.values()):
        raise ValueError(
            "PromiseTreeGRPOTrainer with packed=True trains each tree as "
            "one row, so what TRL computes per row would take a whole tree "
            f"for a node: {', '.join(k for k, v in per_row.items() if v)}; "
            "pass packed=False (a row per node)")
