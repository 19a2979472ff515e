# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""SIGTERM stops `vllm serve` (V0) with streams in flight (hardening/0004).

Each case takes a hooked server on the tiny model, in a session of its
own (so the server's process group holds it, its engine process and
their helpers): the first the suite's shared one, after the tests that
served on it, the second a new one. Each opens N streamed completions
whose parents promise and sync at once (parked) while their children
write 200 tokens, each engine step lasting 50 ms
(`scripted_hooks.SlowScriptedHooks`): every stream is still running when
SIGTERM reaches the server's main process. The server
must exit 0 (one not gone after HANG_S hangs), every stream must end with
a final event (an error object or a finish reason) and `data: [DONE]`,
never a torn connection, and no live process of the group may be left.
Stock vLLM 0.9.2 never exits here: uvicorn waits for the connections to
close, and the requests behind them wait for outputs that will never
come.
"""

import contextlib
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import pytest

from sequence_hooks_testkit.server import metric, scripted_request_body
from sequence_hooks_testkit.shutdown_check import (Stream,
                                                   live_processes_of_group,
                                                   wait_until)

# The shared servers its tests use (conftest's `shared_servers`).
pytestmark = pytest.mark.shares("hooked")

# Not a speed bound (docs/serving.md, Shutdown: the engine process's join
# takes 4 s at most, then it is killed; the report prints the time): a
# server that has not exited by then hangs, as stock vLLM 0.9.2 does here.
HANG_S = 120.0
# Each engine step lasts this long at least while the requests run.
STEP_SECONDS = 0.05
CHILD_TOKENS = 200
# The engine's helpers (multiprocessing's resource tracker) leave when the
# main process has gone; this long is allowed for it.
GROUP_GRACE_S = 2.0
STREAM_START_S = 45.0


def log_tail(log: Path, lines: int = 12) -> str:
    """The server log's last lines, without the per-request ones."""
    chatter = ("Received request", "Added request", "POST /v1", "GET /")
    kept = [
        line for line in log.read_text().splitlines()
        if not any(word in line for word in chatter)
    ]
    return "\n".join(kept[-lines:])


@pytest.fixture
def server_group(shared_servers):
    """A hooked `vllm serve` leading a process group of its own: the
    suite's shared one, taken (the tests that served on it have run), or
    a new one if another test took it.

    Yields:
        The server's main process, its base URL and its log's path. The
        whole group is SIGKILLed after the test, whatever happened.
    """
    server = shared_servers.take("hooked")
    try:
        yield server.process, server.base, server.log
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()


@pytest.mark.parametrize("n", [8, 64])
def test_sigterm_ends_every_stream_and_exits(server_group, tiny_model_path,
                                             hook_ids, n):
    process, base, log = server_group
    model = str(tiny_model_path)
    # The parent promises and syncs at once, parked while its child writes.
    plans = {
        (): [hook_ids.promise, hook_ids.sync] + [None] * 20,
        (0, ): [None] * CHILD_TOKENS,
    }
    body = dict(model=model,
                prompt="the cat sees",
                max_tokens=230,
                temperature=0.0,
                stream=True,
                **scripted_request_body(plans,
                                        hook_ids,
                                        step_seconds=STEP_SECONDS))
    streams = [Stream(f"{base}/v1/completions", body) for _ in range(n)]
    for stream in streams:
        stream.start()
    wait_until(lambda: all(s.events or not s.is_alive() for s in streams),
               STREAM_START_S, "streams did not start")
    children = "vllm:sequence_hook_children_running"
    wait_until(lambda: metric(base, children, model) > 0, STREAM_START_S,
               "no child running")
    assert all(s.is_alive() and s.events
               for s in streams), Counter(s.outcome() for s in streams)

    start = time.monotonic()
    os.kill(process.pid, signal.SIGTERM)
    try:
        code: Optional[int] = process.wait(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        code = None
    elapsed = time.monotonic() - start
    left = live_processes_of_group(process.pid,
                                   GROUP_GRACE_S if code is not None else 0)
    if code is None:
        # Hung: end it now, so that the streams end and can be reported.
        os.killpg(process.pid, signal.SIGKILL)
    for stream in streams:
        stream.join(10)
    outcomes = Counter(s.outcome() for s in streams)
    report = (f"{n} streams: exit {code} after {elapsed:.2f} s; "
              f"streams: {dict(outcomes)}; left running: {left}")
    print(report)

    assert code == 0, f"{report}; server log's tail:\n{log_tail(log)}"
    for stream in streams:
        assert stream.exception is None, report  # no torn connection
        assert stream.done, report  # `data: [DONE]` came
        assert stream.error is not None or stream.finish_reason, report
    assert not left, report
