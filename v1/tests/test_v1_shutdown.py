# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""SIGTERM to the hooked V1 server with streams in flight: it exits 0
(it does not hang), every stream ends with a final event and `[DONE]`,
no client sees a torn connection, no process is left.

The server is served as docs/v1.md says (`--middleware
vllm_sequence_hooks.shutdown.FinishStreamsOnShutdown`); each engine step
that runs the streams is slowed by 50 ms so that, when the signal comes,
the parents have promised and are parked at their `<sync>` and their
children are still writing. Without the middleware the server hangs in
upstream's shutdown (a race: docs/v1.md, Shutdown). One case starts its
server, with the plugin's own metrics folder; the other takes the suite's
shared one with the user's (conftest's `shared_servers`), after the tests
that served on it (test_v1_serving.py, just before).
"""

import contextlib
import os
import signal

import pytest

from sequence_hooks_testkit.shutdown_check import (Stream,
                                                   live_processes_of_group,
                                                   wait_until)
from sequence_hooks_testkit.v1_server import (metric, scripted_body,
                                              start_hooked_v1_server)

SHARED = "hooked, the user's metrics folder"
# The shared servers its tests use (conftest's `shared_servers`).
pytestmark = pytest.mark.shares(SHARED)

# Not a speed bound (docs/v1.md gives the times measured): a server that
# has not exited by then hangs, as it does without the middleware. On an
# idle machine it exits in under a second; in a loaded CI run (2026-11-28,
# load average about 5) it once took over 5 s.
HANG_S = 120.0
STEP_DELAY_S = 0.05


@pytest.mark.parametrize("streams, shared", [(8, False), (64, True)],
                         ids=["8-own", "64-shared"])
def test_sigterm_ends_every_stream_and_exits(tiny_model_path, hook_ids,
                                             shared_servers, tmp_path, streams,
                                             shared):
    if shared:
        server = shared_servers.take(SHARED)
        process, url = server.process, server.url
    else:
        process, url = start_hooked_v1_server(tiny_model_path, tmp_path)
    try:
        P, S = hook_ids.promise, hook_ids.sync
        plans = {(): [None, P, S, None], (0, ): [None] * 200}
        clients = [
            Stream(
                url + "/v1/completions",
                scripted_body(plans,
                              hook_ids,
                              tiny_model_path,
                              True,
                              max_tokens=240,
                              step_delay_s=STEP_DELAY_S))
            for _ in range(streams)
        ]
        for client in clients:
            client.start()
        wait_until(lambda: all(client.events for client in clients), 120,
                   "not every stream started")
        wait_until(lambda: metric(url, "parents_parked") > 0, 30,
                   "no parent parked")
        assert metric(url, "children_running") > 0
        assert all(client.is_alive() for client in clients)
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=HANG_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    for client in clients:
        client.join(10)
    assert code == 0
    for client in clients:
        assert client.exception is None, client.outcome()
        assert client.done
        assert client.finish_reason == "abort" or client.error
    assert not live_processes_of_group(process.pid, grace=5)
