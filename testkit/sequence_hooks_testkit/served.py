# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A hooked and a stock `vllm serve` on loopback, and what a request got.

The fault tests send hostile or unusual requests to both servers and then
check that each still answers `/health` and a known request with its
known answer (recorded when the server started). Every wait is bounded.
"""

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import httpx

from sequence_hooks_testkit.programs import two_children
from sequence_hooks_testkit.server import (free_port, scripted_request_body,
                                           serve_command, server_env,
                                           spawn_logged)

PROMPT = "the cat sees"
REQUEST_SECONDS = 60
# Two servers start at once, on a shared 2-core machine.
STARTUP_SECONDS = 600


@dataclass
class Reply:
    """What one request got back."""
    # HTTP status.
    status: int
    # The body: JSON for plain requests, the raw event stream if streamed.
    body: object
    # The raw body text.
    text: str

    @property
    def error_message(self) -> str:
        """The message of an error reply (or of an error inside a stream)."""
        if isinstance(self.body, dict):
            return self.body.get("message") or self.body.get("error", {}).get(
                "message", "")
        return self.text


@dataclass
class Served:
    """One running server and the known request it must keep answering."""
    # "hooked" (with --special-kwargs) or "stock".
    name: str
    # http://127.0.0.1:<port>
    base: str
    # The served model's name (its folder).
    model: str
    # The server process.
    process: subprocess.Popen
    # Its log.
    log: Path
    # Fields every request to it carries: the hooked server's requests run
    # a promise/sync program, so its hooks act on them.
    extra: dict
    # The known request's body and its answer at start.
    known_body: Optional[dict] = None
    known_text: str = ""

    @property
    def hooked(self) -> bool:
        return self.name == "hooked"

    def post(self, path: str, body: dict) -> Reply:
        """Posts JSON (ASCII-escaped, as a hostile client may send lone
        surrogates) and reads the whole reply, streamed or not."""
        data = json.dumps(body, ensure_ascii=True)
        response = httpx.post(f"{self.base}{path}",
                              content=data,
                              headers={"content-type": "application/json"},
                              timeout=REQUEST_SECONDS)
        try:
            parsed = response.json()
        except ValueError:
            parsed = None
        return Reply(response.status_code, parsed, response.text)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.base}/health",
                             timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def known_answer(self) -> str:
        reply = self.post("/v1/completions", self.known_body)
        assert reply.status == 200, reply.text
        return reply.body["choices"][0]["text"]

    def assert_still_serving(self) -> None:
        """Health, and the known request's known answer."""
        assert self.process.poll() is None, self.log.read_text()[-3000:]
        assert self.healthy(), self.log.read_text()[-3000:]
        assert self.known_answer() == self.known_text


def start(name: str,
          model: Path,
          log: Path,
          hook_ids,
          own_session: bool = False) -> Served:
    """Starts `vllm serve` for ``name`` ("hooked" or "stock"); in a
    session of its own if ``own_session`` (its process group then holds
    it, its engine process and their helpers)."""
    port = free_port()
    command = serve_command(model, port)
    env = server_env()
    if name == "stock":
        at = command.index("--special-kwargs")
        del command[at:at + 2]
        # The fork serves V0; the stock server runs the same engine.
        env["VLLM_USE_V1"] = "0"
        extra = {}
    else:
        extra = scripted_request_body(two_children(hook_ids), hook_ids)
    process = spawn_logged(command,
                           log,
                           env=env,
                           start_new_session=own_session)
    return Served(name, f"http://127.0.0.1:{port}", str(model), process, log,
                  extra)


def wait_ready(server: Served) -> None:
    """Waits for health, then records the known request's answer."""
    deadline = time.monotonic() + STARTUP_SECONDS
    while not server.healthy():
        assert server.process.poll() is None, server.log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{server.name} did not start"
        time.sleep(1)
    server.known_body = completion(server, max_tokens=40)
    server.known_text = server.known_answer()
    assert server.known_text.strip()


def stop(server: Served) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait(timeout=30)


def completion(server: Served, **fields) -> dict:
    """A greedy completion request to ``server`` with ``fields``."""
    return {
        "model": server.model,
        "prompt": PROMPT,
        "max_tokens": 40,
        "temperature": 0.0,
        **server.extra,
        **fields
    }


def chat(server: Served, **fields) -> dict:
    """A greedy chat request to ``server`` with ``fields``."""
    return {
        "model": server.model,
        "messages": [{
            "role": "user",
            "content": PROMPT
        }],
        "max_tokens": 40,
        "temperature": 0.0,
        **server.extra,
        **fields
    }
