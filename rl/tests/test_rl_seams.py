# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tripwires on the TRL members `vllm_sequence_hooks_rl` relies on: each
must be the code it was written against (`TRL_SEAMS`), and only a
supported TRL release is accepted."""

import hashlib
import importlib
import inspect

import pytest
import trl
from vllm_sequence_hooks_rl import (SUPPORTED_TRL_VERSIONS, TRL_SEAMS,
                                    PromiseTreeGRPOTrainer)


@pytest.mark.parametrize("member", sorted(TRL_SEAMS))
def test_each_trl_member_is_the_code_it_was_written_against(member):
    module, qualified = member.split(":")
    target = importlib.import_module(module)
    for name in qualified.split("."):
        target = getattr(target, name)
    source = inspect.getsource(target)
    _, recorded = TRL_SEAMS[member]
    assert hashlib.sha256(source.encode()).hexdigest() == recorded, (
        f"TRL changed {member}: check what vllm_sequence_hooks_rl relies "
        "on (the why in trl_seams.TRL_SEAMS) against the new code, then "
        "record its sha256")


def test_the_swapped_engine_name_is_trls_vllm_llm():
    import trl.generation.vllm_generation as trl_vllm_generation

    from vllm import LLM
    assert trl_vllm_generation.LLM is LLM


def test_an_untested_trl_is_refused(monkeypatch):
    assert trl.__version__ in SUPPORTED_TRL_VERSIONS
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(RuntimeError,
                       match="supports TRL 1.16.0, not the installed 1.17.0"):
        PromiseTreeGRPOTrainer(special_kwargs={})
