# SPDX-License-Identifier: Apache-2.0
"""Fixtures shared by the fork's tests: the V0 engine and the tiny model."""

from dataclasses import dataclass
from pathlib import Path

import pytest
from engines import tiny_llm
from tiny_model import CHILD, PROMISE, SYNC, build_tiny_model, build_tokenizer

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
    return tiny_llm(tiny_model_path)


@dataclass(frozen=True)
class HookIds:
    """Token ids of the tiny tokenizer that the hook tests use."""
    # `<sync>`: join the children.
    sync: int
    # `<promise>`: spawn a child.
    promise: int
    # `<child>`: the role marker.
    child: int
    # End of sequence.
    eos: int


@pytest.fixture(scope="session")
def hook_ids() -> HookIds:
    tokenizer = build_tokenizer()
    return HookIds(*tokenizer.convert_tokens_to_ids([SYNC, PROMISE, CHILD]),
                   tokenizer.eos_token_id)


@pytest.fixture(scope="session")
def hooks(hook_ids) -> dict:
    """The least `special_kwargs` (as a dict) that turns the hooks on."""
    return {
        "sync_token_id": hook_ids.sync,
        "promise_token_id": hook_ids.promise
    }


@pytest.fixture(scope="session")
def tiny_tokenizer_path(tmp_path_factory) -> Path:
    """The tiny tokenizer alone, for tests that run no model."""
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hooked_llm(tiny_model_path, hook_ids):
    """One V0 engine with sequence hooks (and the role marker) a session.

    Stats logging is on, as in `vllm serve`, so every test runs through it.
    """
    return tiny_llm(tiny_model_path, hook_ids, disable_log_stats=False)
