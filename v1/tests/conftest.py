# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the V1 suite: in-process V1 engines over the tiny model.

Runs in `.venv-v1` (stock vLLM 0.32 and the plugin). The tiny model and the
program definitions come from the V0 suite in `mytests/`.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

MYTESTS = Path(__file__).resolve().parents[2] / "mytests"
sys.path.insert(0, str(MYTESTS))

# Before vLLM is imported: the engine core in this process (5 s to start
# instead of 15), no hub access, a small KV cache.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import tiny_model  # noqa: E402  (mytests/tiny_model.py)


def _v0_conftest():
    # mytests/conftest.py, under another name than this module's.
    spec = importlib.util.spec_from_file_location("mytests_conftest",
                                                  MYTESTS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HookIds = _v0_conftest().HookIds


def v1_llm(model_path: Path, hook_ids=None, **engine_kwargs):
    """A V1 `LLM` over the tiny model (fp32, eager), hooked if ids given.

    Args:
        model_path: The tiny model's folder.
        hook_ids: `HookIds` to turn the hooks on (role marker included).
        engine_kwargs: Overrides of the engine arguments.
    """
    from scripted_logits import RandomHooksV1, ScriptedHooksV1
    from vllm_sequence_hooks import hooked_engine_args

    from vllm import LLM
    if hook_ids is not None:
        engine_kwargs.update(
            hooked_engine_args({
                "sync_token_id": hook_ids.sync,
                "promise_token_id": hook_ids.promise,
                "child_role_token_id": hook_ids.child,
            }))
    return LLM(model=str(model_path),
               **{
                   "max_model_len": 256,
                   "enforce_eager": True,
                   "dtype": "float32",
                   "seed": 0,
                   "logits_processors": [ScriptedHooksV1, RandomHooksV1],
                   **engine_kwargs
               })


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint with the hook tokens, made once a session."""
    return tiny_model.build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def hook_ids() -> HookIds:
    tokenizer = tiny_model.build_tokenizer()
    return HookIds(
        *tokenizer.convert_tokens_to_ids(
            [tiny_model.SYNC, tiny_model.PROMISE, tiny_model.CHILD]),
        tokenizer.eos_token_id)


@pytest.fixture(scope="session")
def hooked_llm(tiny_model_path, hook_ids):
    """One V1 engine with the hook scheduler (and role marker) a session."""
    return v1_llm(tiny_model_path, hook_ids)


@pytest.fixture(scope="session")
def plain_llm(hooked_llm):
    """The engine the hook-free reference runs on: the hooked one.

    A second V1 engine in the same process computes wrong logits (its
    greedy tokens differ from a lone engine's), so the reference runs on
    the hooked engine, as `mytests/run_programs.py` does: each reference
    segment ends at its `<sync>` as the request's last token, which
    finishes it instead of parking it, so the parent's tokens are the
    plain engine's. Children its promises spawn are aborted with it.
    """
    return hooked_llm
