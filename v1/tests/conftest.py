# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the V1 suite: in-process V1 engines over the tiny model, and
the servers several modules share.

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
# The shared servers' hooks (their users declared, each stopped once no
# test left needs it).
from sequence_hooks_testkit.shared_servers import (  # noqa: E402, F401
    pytest_collection_finish, pytest_configure, pytest_runtest_teardown,
    shared, shared_servers)
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


@pytest.fixture(scope="session")
def all_shared_servers(request, tiny_model_path, tmp_path_factory):
    """The servers several modules share, by name (`shared_servers`: each
    starts at its first use and stops once no test left declares it; a
    test that ends one takes it):

    - "hooked, the user's metrics folder": the hooked server of the tiny
      model, as `start_hooked_v1_server` starts it, with a
      `PROMETHEUS_MULTIPROC_DIR` a user set, new at each start (its
      `Started.prometheus_dir`: test_v1_serving.py; taken by
      test_v1_shutdown.py);
    - "data parallel": the hooked server with two engine cores
      (test_v1_data_parallel.py; taken by test_v1_engine_death.py);
    - "threadweaver toy", "apr toy", "npr toy", "multiverse toy": each
      format's toy with the format in-engine (`start_format_server`:
      test_formats_*_in_engine.py, test_formats_fuzz_served.py).
    """
    from sequence_hooks_testkit import v1_data_parallel as dp
    from sequence_hooks_testkit.formats.toy_server import start_format_server
    from sequence_hooks_testkit.server import Started, stop_server
    from sequence_hooks_testkit.v1_server import start_hooked_v1_server

    def user_metrics_folder() -> Started:
        # A folder of its own: the gauges of a server killed in it
        # (multiprocess mode "sum") would count in the next one's.
        work_dir = tmp_path_factory.mktemp("hooked-user-metrics")
        prometheus_dir = work_dir / "prometheus"
        prometheus_dir.mkdir()
        process, url = start_hooked_v1_server(tiny_model_path,
                                              work_dir,
                                              prometheus_dir=prometheus_dir)
        return Started(process, url, work_dir / "server.log", prometheus_dir)

    def data_parallel() -> Started:
        work_dir = tmp_path_factory.mktemp("dp")
        process, url = dp.start_data_parallel_server(tiny_model_path, work_dir,
                                                     2)
        return Started(process, url, work_dir / "server.log")

    def format_server(name: str):
        return lambda: start_format_server(
            name,
            tmp_path_factory.mktemp(name) / "server.log")

    yield from shared(
        request, {
            "hooked, the user's metrics folder": user_metrics_folder,
            "data parallel": data_parallel,
            "threadweaver toy": format_server("threadweaver"),
            "apr toy": format_server("apr"),
            "npr toy": format_server("npr"),
            "multiverse toy": format_server("multiverse"),
        }, lambda server: stop_server(server.process))
