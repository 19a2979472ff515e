# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures shared by the fork's tests: the V0 engine, the tiny model and
the server several modules share."""

from pathlib import Path

import pytest

from sequence_hooks_testkit.engines import tiny_llm
from sequence_hooks_testkit.served import start, stop, wait_ready
# The shared servers' hooks (their users declared, each stopped once no
# test left needs it).
from sequence_hooks_testkit.shared_servers import (  # noqa: F401 (hooks)
    pytest_collection_finish, pytest_configure, pytest_runtest_teardown,
    shared, shared_servers)
from sequence_hooks_testkit.tiny_model import (HookIds, build_tiny_model,
                                               build_tokenizer, tiny_hook_ids)
from sequence_hooks_training import expand_eval

# Small KV cache (GiB) for the CPU engine; the tiny model needs little.
KV_CACHE_GIB = "1"
# The embedded model trained to speak promise/sync (models/expand).
EXPAND_MODEL = Path(__file__).resolve().parent.parent / "models" / "expand"


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


@pytest.fixture(scope="session")
def hook_ids() -> HookIds:
    return tiny_hook_ids()


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


@pytest.fixture(scope="session")
def expand_model_path() -> Path:
    return EXPAND_MODEL


@pytest.fixture(scope="session")
def expand_llm(expand_model_path):
    """The embedded model on the hooked engine, as its card measures it."""
    return expand_eval.load(str(expand_model_path))


@pytest.fixture(scope="session")
def all_shared_servers(request, tiny_model_path, hook_ids, tmp_path_factory):
    """The servers several modules share, by name (`shared_servers`: each
    starts at its first use and stops once no test left declares it; a
    test that ends one takes it): "hooked", the hooked server of
    `served.start`, its known answer recorded, in a session of its own
    (test_client_join.py, test_server_faults.py, test_serving.py; taken
    by test_shutdown.py)."""

    def hooked():
        log = tmp_path_factory.mktemp("hooked-server") / "server.log"
        server = start("hooked",
                       tiny_model_path,
                       log,
                       hook_ids,
                       own_session=True)
        try:
            wait_ready(server)
        except BaseException:
            stop(server)
            raise
        return server

    yield from shared(request, {"hooked": hooked}, stop)
