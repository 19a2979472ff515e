# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What `PromiseTreeGRPOTrainer` cannot train right is refused before TRL
builds anything (no engine starts): each setting with a message naming
it. A reward weighted far below the others is refused while advantages
are divided by a standard deviation, and a small spread scaled that way
is counted for the trainer's warning."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from trl import GRPOConfig
from vllm_sequence_hooks_rl import PromiseTreeGRPOTrainer, settings


@pytest.fixture(scope="module")
def model(real_model):
    return AutoModelForCausalLM.from_pretrained(real_model,
                                                dtype=torch.float32)


def config(tmp_path, **changes) -> GRPOConfig:
    settings = dict(output_dir=str(tmp_path),
                    use_vllm=True,
                    vllm_mode="colocate",
                    use_cpu=True,
                    bf16=False,
                    report_to=[])
    return GRPOConfig(**{**settings, **changes})


@pytest.mark.parametrize(
    "changes, reason", [
        (dict(use_vllm=False), "use_vllm=True, vllm_mode='colocate'"),
        (dict(vllm_mode="server"), "use_vllm=True, vllm_mode='colocate'"),
        (dict(vllm_enable_sleep_mode=True), "vllm_enable_sleep_mode"),
        (dict(vllm_tensor_parallel_size=2), "vllm_tensor_parallel_size > 1"),
        (dict(loss_type="grpo"), "not 'grpo'"),
        (dict(loss_type="bnpo"), "not 'bnpo'"),
        (dict(reward_weights=[1.0, 0.05]), "scale_rewards='group'"),
        (dict(reward_weights=[1.0, 0.25],
              scale_rewards="batch"), "scale_rewards='batch'"),
        (dict(reward_weights=[-0.05, 1.0, 0.0]), "scale_rewards='group'"),
        (dict(reward_weights=[0.05, 1.0],
              scale_rewards="none",
              multi_objective_aggregation="normalize_then_sum"),
         "'normalize_then_sum'"),
        (dict(loss_type="vespo"), "packed=True .*loss_type='vespo'"),
        (dict(importance_sampling_level="sequence", loss_type="cispo"),
         "packed=True .*importance_sampling_level='sequence'"),
        (dict(off_policy_mask_threshold=0.5),
         "packed=True .*off_policy_mask_threshold"),
        (dict(mask_truncated_completions=True),
         "packed=True .*mask_truncated_completions"),
    ],
    ids=[
        "no-vllm", "server", "sleep-mode", "tensor-parallel", "loss-grpo",
        "loss-bnpo", "small-reward-group-scaled", "small-reward-batch-scaled",
        "small-penalty-group-scaled", "small-reward-normalized-per-function",
        "packed-vespo", "packed-sequence-ratio", "packed-off-policy-mask",
        "packed-truncation-mask"
    ])
def test_a_setting_it_cannot_train_is_refused(model, tmp_path, changes,
                                              reason):
    with pytest.raises(ValueError, match=reason):
        PromiseTreeGRPOTrainer(model=model,
                               reward_funcs=[],
                               args=config(tmp_path, **changes),
                               special_kwargs={})


@pytest.mark.parametrize("changes", [
    dict(reward_weights=[1.0, 0.05], scale_rewards="none"),
    dict(reward_weights=[1.0, 0.5]),
    dict(reward_weights=[0.05]),
    dict(reward_weights=[1.0, -0.5, 0.0]),
],
                         ids=[
                             "unscaled", "comparable-weights", "one-reward",
                             "comparable-penalty-and-one-off"
                         ])
def test_a_reward_scaled_or_weighted_safely_is_accepted(
        model, tmp_path, changes):
    # The checks that run before TRL builds anything pass (the trainer's
    # construction would start an engine).
    settings.check_config(model, config(tmp_path, **changes))


def test_per_row_settings_are_accepted_with_a_row_per_node(model, tmp_path):
    settings.check_config(model,
                          config(tmp_path,
                                 loss_type="vespo",
                                 mask_truncated_completions=True),
                          packed=False)


def test_a_model_name_is_refused(real_model, tmp_path):
    with pytest.raises(ValueError, match="takes the model loaded"):
        PromiseTreeGRPOTrainer(model=str(real_model),
                               reward_funcs=[],
                               args=config(tmp_path),
                               special_kwargs={})


def test_small_spreads_are_counted_per_group():
    groups = [
        [0.50, 0.50, 0.50, 0.50],  # tied: no spread
        [0.50, 0.51, 0.50, 0.50],  # a path term's difference: small
        [0.00, 0.25, 0.00, 0.00],  # a capital of 4: not small
        [0.80, 0.801, 0.80, 0.80],  # small
    ]
    rewards = torch.tensor(groups).flatten()
    assert settings.small_spread_groups(rewards, 4) == 2
    assert settings.small_spread_groups(rewards, 4, threshold=0.2) == 3
    assert settings.small_spread_groups(rewards[:4], 4) == 0
