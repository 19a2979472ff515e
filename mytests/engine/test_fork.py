# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The installed ``vllm`` is this fork, and its V0 engine runs on the CPU."""

import importlib.metadata

import pytest


def test_installed_vllm_is_the_fork():
    import vllm
    version = importlib.metadata.version("vllm")
    assert version.startswith("0.9.2+seqhook.")
    assert vllm.__version__ == version


def test_cpu_platform_is_detected():
    from vllm.platforms import current_platform
    from vllm.platforms.cpu import CpuPlatform
    assert isinstance(current_platform, CpuPlatform)


def test_compiled_extension_loads():
    import torch

    import vllm._C  # noqa: F401

    # The op the CPU worker's thread binding calls.
    assert hasattr(torch.ops._C_utils, "init_cpu_threads_env")


def test_generate_runs_on_the_v0_engine(plain_llm):
    from vllm import SamplingParams
    from vllm.engine.llm_engine import LLMEngine
    outputs = plain_llm.generate(["the cat sees", "one two"],
                                 SamplingParams(temperature=0.0,
                                                max_tokens=8,
                                                ignore_eos=True))
    assert type(plain_llm.llm_engine) is LLMEngine
    assert [o.prompt for o in outputs] == ["the cat sees", "one two"]
    for output in outputs:
        assert len(output.outputs[0].token_ids) == 8
        assert output.outputs[0].text.strip()


def test_stock_configuration_keeps_the_stock_output_processor(plain_llm):
    from vllm.engine.output_processor.single_step import (
        SingleStepOutputProcessor)
    assert (type(plain_llm.llm_engine.output_processor)
            is SingleStepOutputProcessor)


@pytest.mark.parametrize("prompt", ["the cat sees", "red blue green"])
def test_greedy_is_deterministic(plain_llm, prompt):
    from vllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = plain_llm.generate([prompt], params)[0].outputs[0].token_ids
    batched = plain_llm.generate([prompt, "one two three four"],
                                 params)[0].outputs[0].token_ids
    assert first == batched


def test_tiny_model_is_deterministic_by_seed(tmp_path):
    from sequence_hooks_testkit.tiny_model import (TinyModelSpec,
                                                   build_tiny_model)
    first = build_tiny_model(tmp_path / "a", TinyModelSpec(seed=3))
    again = build_tiny_model(tmp_path / "b", TinyModelSpec(seed=3))
    other = build_tiny_model(tmp_path / "c", TinyModelSpec(seed=4))
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (again / name).read_bytes()
    weights = "model.safetensors"
    assert (first / weights).read_bytes() != (other / weights).read_bytes()
