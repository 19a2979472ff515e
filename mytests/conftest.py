# SPDX-License-Identifier: Apache-2.0
"""Fixtures shared by the fork's tests: the V0 engine and the tiny model."""

from pathlib import Path

import pytest
from tiny_model import build_tiny_model

# Small KV cache (GiB) for the CPU engine; the tiny model needs little.
KV_CACHE_GIB = "1"


@pytest.fixture(scope="session", autouse=True)
def use_v0_engine():
    """Selects the V0 engine, as vLLM's own V0 tests do.

    Session-scoped (autouse fixtures run first within their scope), so it is
    in force before any session-scoped engine fixture starts an engine.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_USE_V1", "0")
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
        yield


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint with the hook tokens, made once a session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def plain_llm(tiny_model_path):
    """One stock-configured V0 engine over the tiny model for the session."""
    from vllm import LLM
    return LLM(model=str(tiny_model_path),
               max_model_len=256,
               enforce_eager=True,
               seed=0)
