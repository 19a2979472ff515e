# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm serve` on a free loopback port, for tests and checks."""

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import httpx

from sequence_hooks_testkit.tiny_model import (CHILD, PROMISE, SPECIAL_TOKENS,
                                               SYNC)

# The hooks as `--special-kwargs` JSON, by token string.
HOOKS_JSON = json.dumps({
    "sync_token": SYNC,
    "promise_token": PROMISE,
    "child_role_token": CHILD
})
# Lets request bodies name the kit's scripted programs as logits processors.
SCRIPTED_PATTERN = r"sequence_hooks_testkit\.scripted_hooks\."
STARTUP_SECONDS = 180
# The `vllm` command of the running interpreter's environment.
VLLM = str(Path(sys.executable).parent / "vllm")


@dataclass(frozen=True)
class Started:
    """A started server: its process (the leader of what it started), its
    base URL, its log and the `PROMETHEUS_MULTIPROC_DIR` it was given (None:
    not set)."""

    process: subprocess.Popen
    url: str
    log: Path
    prometheus_dir: Optional[Path] = None


def free_port() -> int:
    """A free TCP port on the loopback address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(
    model,
    port: int,
    special_kwargs: Optional[str] = HOOKS_JSON,
    extra: Sequence[str] = ()
) -> list[str]:
    """`vllm serve` of ``model`` on 127.0.0.1:``port``, fp32, eager.

    Args:
        model: The model's folder.
        port: The port.
        special_kwargs: `--special-kwargs` JSON; None for a stock server.
        extra: Further arguments.
    """
    command = [
        VLLM, "serve",
        str(model), "--host", "127.0.0.1", "--port",
        str(port), "--max-model-len", "256", "--enforce-eager", "--dtype",
        "float32", "--logits-processor-pattern", SCRIPTED_PATTERN
    ]
    if special_kwargs is not None:
        command += ["--special-kwargs", special_kwargs]
    return command + list(extra)


def server_env() -> dict:
    """The environment of a test server.

    No VLLM_USE_V1: the fork must choose V0 for a hooked model itself.
    """
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V1"}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    return env


def spawn_logged(command: Sequence[str], log: Path,
                 **popen_kwargs) -> subprocess.Popen:
    """Starts ``command`` with its output and errors written to ``log``;
    ``popen_kwargs`` as `subprocess.Popen` takes them."""
    with log.open("w") as out:
        return subprocess.Popen(command,
                                stdout=out,
                                stderr=subprocess.STDOUT,
                                **popen_kwargs)


def wait_healthy(process: subprocess.Popen,
                 base: str,
                 log: Path,
                 seconds: float = STARTUP_SECONDS) -> None:
    """Polls ``base``/health until it answers 200, within ``seconds``.

    Raises:
        AssertionError: the server exited (with its log's tail) or did not
            start in time.
    """
    deadline = time.monotonic() + seconds
    while True:
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "server did not start"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)


@contextmanager
def running_server(
    model,
    log: Path,
    special_kwargs: Optional[str] = HOOKS_JSON,
    extra: Sequence[str] = ()
) -> Iterator[str]:
    """Runs `vllm serve` for the ``with`` block and stops it after.

    Args:
        model: The model's folder.
        log: File for the server's output.
        special_kwargs: `--special-kwargs` JSON; None for a stock server
            (on the V0 engine, as the hooked one).
        extra: Further `vllm serve` arguments.

    Yields:
        The server's base URL.
    """
    port = free_port()
    env = server_env()
    if special_kwargs is None:
        # A stock server runs the same V0 engine as the hooked one.
        env["VLLM_USE_V1"] = "0"
    process = spawn_logged(serve_command(model, port, special_kwargs, extra),
                           log,
                           env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, base, log)
        yield base
    finally:
        stop_server(process)


def stop_server(process: subprocess.Popen, seconds: float = 30) -> None:
    """Stops a server: SIGTERM, then SIGKILL if it has not exited within
    ``seconds``."""
    process.terminate()
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def metric(base: str, name: str, model: str) -> float:
    """A metric's value on ``base``/metrics for the served ``model``.

    Raises:
        AssertionError: if the metric is not exported.
    """
    text = httpx.get(f"{base}/metrics", timeout=10).text
    prefix = f'{name}{{model_name="{model}"}} '
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    raise AssertionError(f"{name} not on /metrics")


def scripted_request_body(plans,
                          ids,
                          role=None,
                          step: int = 0,
                          step_seconds: Optional[float] = None) -> dict:
    """The request-body field that forces a promise/sync program.

    Args:
        plans: Plans by role path (see `scripted_hooks.ScriptedHooks`).
        ids: The tiny tokenizer's `HookIds`.
        role: A fixed role path, for a stock server that serves one
            sequence's segment (the client-side join); None on a hooked
            server, where each sequence finds its own.
        step: The plan step a fixed role starts at.
        step_seconds: If given, each engine step running the request lasts
            that long at least (`scripted_hooks.SlowScriptedHooks`).
    """
    options = {} if role is None else {"role": list(role), "step": step}
    builder = "from_role_plans"
    if step_seconds is not None:
        builder = "slow_from_role_plans"
        options["step_seconds"] = step_seconds
    return {
        "logits_processors": [{
            "qualname": f"sequence_hooks_testkit.scripted_hooks.{builder}",
            "kwargs": {
                "role_plans":
                [[list(role), plan] for role, plan in plans.items()],
                "promise_id": ids.promise,
                "child_id": ids.child,
                "eos_id": ids.eos,
                "masked_ids": list(range(len(SPECIAL_TOKENS))),
                **options,
            },
        }]
    }
