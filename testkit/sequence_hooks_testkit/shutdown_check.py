# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the shutdown tests of both flavours watch: streamed requests and
the server's process group (mytests/serving/test_shutdown.py,
v1/tests/test_v1_shutdown.py). No vLLM import: only the client's side.
"""

import json
import threading
import time
from pathlib import Path
from typing import Optional

import httpx


class Stream(threading.Thread):
    """One streamed /v1/completions request; records how it ended."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events = 0
        self.finish_reason: Optional[str] = None
        self.error: Optional[dict] = None
        self.done = False
        self.exception: Optional[Exception] = None

    def run(self):
        try:
            with httpx.stream("POST", self.url, json=self.body,
                              timeout=60) as response:
                response.raise_for_status()
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
        except Exception as e:  # a torn connection, above all
            self.exception = e

    def outcome(self) -> str:
        """How the stream ended, in a word or two (for the report)."""
        if self.exception is not None:
            return f"torn ({type(self.exception).__name__})"
        if self.is_alive():
            return "still open"
        if self.error is not None:
            final = f"error {self.error.get('code')}"
        elif self.finish_reason is not None:
            final = f"finish_reason {self.finish_reason}"
        else:
            final = "no final event"
        return final + (" + [DONE]" if self.done else ", no [DONE]")


def live_processes_of_group(pgid: int, grace: float = 0) -> list[str]:
    """The processes of group ``pgid`` that are not zombies, once none is
    left or after ``grace`` seconds.

    This sandbox's PID 1 reaps no orphan, so zombies stay; they hold nothing.
    """
    deadline = time.monotonic() + grace
    while (live := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return live


def group_members(pgid: int) -> list[str]:
    """The processes of group ``pgid`` other than zombies, as
    "pid state name"."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name_end = text.rindex(")")
        state, _, pgrp = text[name_end + 2:].split()[:3]
        if int(pgrp) == pgid and state not in ("Z", "X"):
            live.append(f"{stat.parent.name} {state} "
                        f"{text[text.index('(') + 1:name_end]}")
    return live


def wait_until(condition, seconds: float, what: str) -> None:
    """Polls ``condition`` until it holds; fails saying ``what`` after
    ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
