# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""SIGTERM to the hooked V1 server with streams in flight: it exits 0
within the documented bound, every stream ends with a final event and
`[DONE]`, no client sees a torn connection, no process is left.

The server is served as docs/v1.md says (`--middleware
vllm_sequence_hooks.shutdown.FinishStreamsOnShutdown`); each engine step
is slowed by 50 ms so that, when the signal comes, the parents have
promised and are parked at their `<sync>` and their children are still
writing. Without the middleware the server hangs in upstream's shutdown
(a race: docs/v1.md, Shutdown).
"""

import contextlib
import json
import os
import signal
import threading
import time

import httpx
import pytest

from sequence_hooks_testkit.v1_server import (metric, scripted_body,
                                              start_hooked_v1_server)

# The documented bound (docs/v1.md): `--shutdown-timeout` (0 here) + 5 s.
EXIT_BOUND_S = 5.0
STEP_DELAY_S = 0.05


class Stream(threading.Thread):
    """One streamed completion; records how it ended."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events = 0
        self.finish_reason = self.error = self.torn = None
        self.done = False

    def run(self) -> None:
        try:
            with httpx.stream("POST",
                              self.url + "/v1/completions",
                              json=self.body,
                              timeout=60) as response:
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[len("data: "):])
                        self.events += 1
                        self.error = event.get("error", self.error)
                        for choice in event.get("choices", ()):
                            self.finish_reason = (choice.get("finish_reason")
                                                  or self.finish_reason)
        except httpx.HTTPError as error:
            self.torn = error


def wait_until(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def live_processes(group: int) -> list[str]:
    """Processes of a process group that are not zombies."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the command: state, parent pid, process group.
        if int(fields[2]) == group and fields[0] != "Z":
            found.append(pid)
    return found


@pytest.mark.parametrize("streams", [8, 64])
def test_sigterm_ends_every_stream_and_exits(tiny_model_path, hook_ids,
                                             tmp_path, streams):
    process, url = start_hooked_v1_server(tiny_model_path,
                                          tmp_path,
                                          step_delay_s=STEP_DELAY_S)
    try:
        P, S = hook_ids.promise, hook_ids.sync
        plans = {(): [None, P, S, None], (0, ): [None] * 200}
        clients = [
            Stream(
                url,
                scripted_body(plans,
                              hook_ids,
                              tiny_model_path,
                              True,
                              max_tokens=240)) for _ in range(streams)
        ]
        for client in clients:
            client.start()
        wait_until(lambda: all(client.events for client in clients), 120,
                   "not every stream started")
        wait_until(lambda: metric(url, "parents_parked") > 0, 30,
                   "no parent parked")
        assert metric(url, "children_running") > 0
        assert all(client.is_alive() for client in clients)
        start = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=EXIT_BOUND_S)
        elapsed = time.monotonic() - start
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    for client in clients:
        client.join(10)
    assert code == 0 and elapsed < EXIT_BOUND_S
    for client in clients:
        assert client.torn is None, client.torn
        assert client.done
        assert client.finish_reason == "abort" or client.error
    wait_until(lambda: not live_processes(process.pid), 5,
               "processes of the server left")
