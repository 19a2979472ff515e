# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the V1 suite: in-process V1 engines over the tiny model.

Runs in `.venv-v1` (stock vLLM 0.32 and the plugin). The tiny model and the
program definitions come from the test kit (`sequence_hooks_testkit`).
"""

import os
from pathlib import Path

import pytest

# Before vLLM is imported: the engine core in this process (5 s to start
# instead of 15), no hub access, a small KV cache.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from sequence_hooks_testkit import tiny_model  # noqa: E402
from sequence_hooks_testkit.tiny_model import HookIds  # noqa: E402
from sequence_hooks_testkit.v1_engines import v1_llm  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint with the hook tokens, made once a session."""
    return tiny_model.build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def hook_ids() -> HookIds:
    return tiny_model.tiny_hook_ids()


@pytest.fixture(scope="session")
def hooked_llm(tiny_model_path, hook_ids):
    """One V1 engine with the hook scheduler (and role marker) a session."""
    return v1_llm(tiny_model_path, hook_ids)


@pytest.fixture(scope="session")
def plain_llm(hooked_llm):
    """The engine the hook-free reference runs on: the hooked one.

    A second V1 engine in the same process computes wrong logits (its
    greedy tokens differ from a lone engine's), so the reference runs on
    the hooked engine, as `sequence_hooks_testkit.run_programs` does: each
    reference segment ends at its `<sync>` as the request's last token, which
    finishes it instead of parking it, so the parent's tokens are the
    plain engine's. Children its promises spawn are aborted with it.
    """
    return hooked_llm
