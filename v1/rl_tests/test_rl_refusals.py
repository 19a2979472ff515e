# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What `PromiseTreeGRPOTrainer` cannot train right is refused before TRL
builds anything (no engine starts): each setting with a message naming
it."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from trl import GRPOConfig
from vllm_sequence_hooks.rl import PromiseTreeGRPOTrainer


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


@pytest.mark.parametrize("changes, reason", [
    (dict(use_vllm=False), "use_vllm=True, vllm_mode='colocate'"),
    (dict(vllm_mode="server"), "use_vllm=True, vllm_mode='colocate'"),
    (dict(vllm_enable_sleep_mode=True), "vllm_enable_sleep_mode"),
    (dict(vllm_tensor_parallel_size=2), "vllm_tensor_parallel_size > 1"),
    (dict(loss_type="grpo"), "not 'grpo'"),
    (dict(loss_type="bnpo"), "not 'bnpo'"),
],
                         ids=[
                             "no-vllm", "server", "sleep-mode",
                             "tensor-parallel", "loss-grpo", "loss-bnpo"
                         ])
def test_a_setting_it_cannot_train_is_refused(model, tmp_path, changes,
                                              reason):
    with pytest.raises(ValueError, match=reason):
        PromiseTreeGRPOTrainer(model=model,
                               reward_funcs=[],
                               args=config(tmp_path, **changes),
                               special_kwargs={})


def test_a_model_name_is_refused(real_model, tmp_path):
    with pytest.raises(ValueError, match="takes the model loaded"):
        PromiseTreeGRPOTrainer(model=str(real_model),
                               reward_funcs=[],
                               args=config(tmp_path),
                               special_kwargs={})
