# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The hooks against their peer, the client-side join, side by side.

The peer is `sequence_hooks_references.client_join`: a client that streams a
request's sequence from a stock engine, launches a child request at each
`<promise>` the sequence samples, stops it at `<sync>` and sends one
request over the merged context, as APR/ThreadWeaver-style systems run on
unmodified vLLM. Both sides run the same greedy work and must end with the
same final texts (printed: the fairness check). Both sides have prefix
caching on, at the same KV block size, and the engine's dtype; each table
row names them. In one run, sides alternating:

- in-process: one fan-out request on a hooked `LLMEngine` against the
  join on a stock one (`EngineSender`), for each k: wall time (median),
  engine steps, prefill tokens scheduled and computed (less prefix-cache
  hits) and peak KV blocks in use;
- HTTP: a hooked `vllm serve` against the join on a stock `vllm serve`,
  a bounded closed loop at each concurrency (1 = latency alone):
  throughput, p50/p90/p99 latency, requests and prefill tokens per task
  (the servers' `vllm:prompt_tokens_total`, which counts prefix-cache hits
  too), and CPU seconds per task of the side's server (all its processes)
  and of this client: where each side's work goes;
- plain: the same requests without hooks on both servers (concurrency 32):
  the hooks' cost to requests that do not use them.

On the tiny test model (default) the work is scripted: a parent writes a
tokens, promises k children of m tokens, syncs and writes n tokens, over
distinct random prompts. With ``--model`` (the real model) it is the
capitals task (`sequence_hooks_training.capitals_task`): the
model's own promises over chat prompts of k countries, parallel form;
plain requests are the sequential form.

Usage: .venv/bin/python benchmarks/peer_join.py [--model DIR --dtype
    bfloat16] [--block-sizes 16 0] [--ks 1 2 4 8 16] [--concurrency 1 8 32
    64] [--out results/peer_join.json]
(block size 0 = the platform's default, 128 on this CPU)
"""

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sequence_hooks.special_kwargs import SpecialKwargs
from sequence_hooks_bench.runs import add_engine_options, prepare, print_table
from sequence_hooks_references.client_join import (EngineSender, JoinTask,
                                                   scripted_options)
from sequence_hooks_references.client_join_http import (HttpSender,
                                                        client_session,
                                                        run_join,
                                                        server_max_model_len)
from sequence_hooks_testkit.oracle import scripted
from sequence_hooks_testkit.schedule_recorder import ScheduleRecorder
from sequence_hooks_testkit.server import (HOOKS_JSON, running_server,
                                           scripted_request_body)
from sequence_hooks_testkit.tiny_model import (CHILD, PROMISE, SYNC, WORDS,
                                               HookIds)

PREFIX_TOKENS = 8  # a
SUFFIX_TOKENS = 8  # n
PROMPT_WORDS = 16
PLAIN_TOKENS = 64
PLAIN_CONCURRENCY = 32
TINY_MAX_MODEL_LEN = 1024
# Tokens of the model length a tiny prompt may take.
TINY_PROMPT_ROOM = 64
REAL_MAX_TOKENS = 256
# `--model`: what it names and its default.
MODEL_HELP = ("a promise-speaking model's folder (default: the tiny test "
              "model, scripted)")


@dataclass
class Task:
    """One request of the workload, the same on both sides."""
    # The prompt, as token ids.
    prompt_ids: list[int]
    # Its budget.
    max_tokens: int
    # The scripted program on the tiny model; None on a real model.
    plans: Optional[dict] = None


class Workload:
    """The model, its hook ids and the tasks both sides run.

    Args:
        args: The command line.
    """

    def __init__(self, args):
        from vllm.transformers_utils.tokenizer import get_tokenizer
        self.real = args.model is not None
        if self.real:
            os.environ.setdefault("VLLM_USE_V1", "0")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
            self.model = args.model
            self.max_model_len = args.max_model_len
        else:
            # Room for 16 children of 32 tokens merged.
            self.max_model_len = TINY_MAX_MODEL_LEN
            _, _, model = prepare(max_positions=self.max_model_len)
            self.model = str(model)
        self.dtype = args.dtype
        self.m = args.m
        self.max_tokens = args.max_tokens or (self.max_model_len -
                                              TINY_PROMPT_ROOM if not self.real
                                              else REAL_MAX_TOKENS)
        self.tokenizer = get_tokenizer(self.model)
        sync, promise, child = self.tokenizer.convert_tokens_to_ids(
            [SYNC, PROMISE, CHILD])
        self.ids = HookIds(sync, promise, child, self.tokenizer.eos_token_id)
        self.special_kwargs = SpecialKwargs(sync_token_id=sync,
                                            promise_token_id=promise,
                                            child_role_token_id=child)
        if self.real:
            from sequence_hooks_training import capitals_task
            self.capitals = capitals_task

    def fan_out(self, k: int, index: int) -> Task:
        """The ``index``-th distinct fan-out task of ``k`` children."""
        rng = random.Random(index)
        if self.real:
            task = self.capitals.make_task(rng,
                                           self.capitals.TRAIN_COUNTRIES,
                                           parallel=True,
                                           num_items=k)
            return Task(self._chat(task), self.max_tokens)
        ids = self.ids
        plans = {
            (): [None] * PREFIX_TOKENS + [ids.promise] * k + [ids.sync] +
            [None] * SUFFIX_TOKENS
        }
        for child in range(k):
            plans[(child, )] = [None] * self.m
        return Task(self._words(rng), self.max_tokens, plans)

    def plain(self, index: int) -> Task:
        """The ``index``-th distinct request that samples no hook token."""
        rng = random.Random(-1 - index)
        if self.real:
            task = self.capitals.make_task(rng,
                                           self.capitals.TRAIN_COUNTRIES,
                                           parallel=False,
                                           num_items=4)
            return Task(self._chat(task), self.max_tokens)
        return Task(self._words(rng), PLAIN_TOKENS,
                    {(): [None] * PLAIN_TOKENS})

    def _words(self, rng: random.Random) -> list[int]:
        prompt = " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))
        return self.tokenizer.encode(prompt)

    def _chat(self, task) -> list[int]:
        return self.tokenizer.apply_chat_template(
            self.capitals.messages_of(task),
            add_generation_prompt=True,
            tokenize=True)

    def engine_options(self, task: Task) -> dict:
        """`SamplingParams` arguments of a hooked request."""
        if task.plans is None:
            return {}
        return {"logits_processors": [scripted(task.plans, self.ids)]}

    def body_options(self, task: Task) -> dict:
        """Request fields of a hooked (or plain) request over HTTP."""
        if task.plans is None:
            return {}
        return scripted_request_body(task.plans, self.ids)

    def join_options(self, task: Task, over_http: bool):
        """The join's options per sequence and segment."""
        if task.plans is None:
            return None
        return scripted_options(task.plans, self.ids, over_http)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class EngineCounter:
    """Counts, per run, a V0 engine's steps, the prefill tokens it
    scheduled and computed, and its peak KV blocks in use.

    Args:
        llm: The `LLM` to watch.
    """

    def __init__(self, llm):
        self.scheduler = llm.llm_engine.scheduler[0]
        self.recorder = ScheduleRecorder(self.scheduler,
                                         observe=self._observe).start()
        self.reset()

    def reset(self) -> None:
        self.recorder.steps.clear()
        self.steps = self.scheduled = self.computed = self.peak_blocks = 0

    def _observe(self, outputs) -> None:
        block_manager = self.scheduler.block_manager
        self.steps += 1
        for scheduled in outputs.scheduled_seq_groups:
            group = scheduled.seq_group
            if not group.is_prefill():
                continue
            seq = group.first_seq
            done = seq.data.get_num_computed_tokens()
            cached = max(0, block_manager.get_num_cached_tokens(seq) - done)
            # A fully cached prefill still computes its last token.
            cached = min(cached, scheduled.token_chunk_size - 1)
            self.scheduled += scheduled.token_chunk_size
            self.computed += scheduled.token_chunk_size - cached
        used = (block_manager.num_total_gpu_blocks -
                block_manager.get_num_free_gpu_blocks())
        self.peak_blocks = max(self.peak_blocks, used)


def engine_pair(workload: Workload, block_size: int):
    """A hooked and a stock `LLM`, both with prefix caching."""
    from sequence_hooks_testkit.engines import tiny_llm
    common = {
        "max_model_len": workload.max_model_len,
        "dtype": workload.dtype,
        "enable_prefix_caching": True,
    }
    if block_size:
        common["block_size"] = block_size
    hooked = tiny_llm(workload.model, workload.ids, **common)
    # The scheduling options hooks turn on.
    stock = tiny_llm(workload.model,
                     enable_chunked_prefill=True,
                     disable_async_output_proc=True,
                     **common)
    return hooked, stock


def in_process(workload: Workload, block_size: int, ks, repeats: int):
    """The in-process rows at one block size."""
    from vllm import SamplingParams
    hooked, stock = engine_pair(workload, block_size)
    actual_block = hooked.llm_engine.cache_config.block_size
    counters = {"hooks": EngineCounter(hooked), "join": EngineCounter(stock)}

    def run_hooks(task: Task, request_id: str):
        engine = hooked.llm_engine
        params = SamplingParams(temperature=0.0,
                                max_tokens=task.max_tokens,
                                **workload.engine_options(task))
        engine.add_request(request_id, {"prompt_token_ids": task.prompt_ids},
                           params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    result = output
        return result.outputs[0].text, 1

    def run_join(task: Task, request_id: str):
        sender = EngineSender(stock.llm_engine, {"temperature": 0.0})
        join = JoinTask(request_id, task.prompt_ids, task.max_tokens,
                        workload.special_kwargs, workload.max_model_len,
                        workload.tokenizer, sender,
                        workload.join_options(task, over_http=False))
        sender.run([join])
        return join.result.text, join.result.requests

    sides = {"hooks": run_hooks, "join": run_join}
    for name, side in sides.items():  # warm-up
        side(workload.fan_out(2, 10**6), f"warm-{name}")
    rows = []
    for k in ks:
        samples = {name: [] for name in sides}
        texts = {name: [] for name in sides}
        for repeat in range(repeats):
            # Both sides run the same task.
            task = workload.fan_out(k, k * 1000 + repeat)
            order = list(sides) if repeat % 2 == 0 else list(sides)[::-1]
            for name in order:
                # No run reuses an earlier run's blocks.
                assert hooked.reset_prefix_cache()
                assert stock.reset_prefix_cache()
                counters[name].reset()
                start = time.perf_counter()
                text, requests = sides[name](task, f"{name}-{k}-{repeat}")
                wall = time.perf_counter() - start
                counter = counters[name]
                samples[name].append(
                    (wall, counter.steps, counter.scheduled, counter.computed,
                     counter.peak_blocks, requests))
                texts[name].append(text)
        same = sum(a == b for a, b in zip(texts["hooks"], texts["join"]))
        row = {
            "block_size": actual_block,
            "dtype": workload.dtype,
            "k": k,
            "same_texts": f"{same}/{repeats}"
        }
        for name in sides:
            rows_of = samples[name]
            row[f"{name}_s"] = round(statistics.median(s[0] for s in rows_of),
                                     4)
            for i, field in enumerate(
                ("steps", "prefill_scheduled", "prefill_computed",
                 "peak_blocks", "requests"),
                    start=1):
                row[f"{name}_{field}"] = statistics.median(s[i]
                                                           for s in rows_of)
        row["join_over_hooks"] = round(row["join_s"] / row["hooks_s"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    for counter in counters.values():
        counter.recorder.stop()
    return rows


async def metric_value(session, base: str, name: str) -> float:
    """The sum of a metric's samples on ``base``/metrics."""
    async with session.get(f"{base}/metrics") as response:
        text = await response.text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
        if line.startswith(name + "{"))


def cpu_seconds(base: Optional[str] = None) -> float:
    """CPU seconds (user and system) used so far by the server at ``base``
    with all its processes, or by this client process if None."""
    import psutil
    if base is None:
        times = psutil.Process().cpu_times()
        return times.user + times.system
    port = base.rsplit(":", 1)[1]
    total = 0.0
    for process in psutil.process_iter(["cmdline"]):
        command = process.info["cmdline"] or []
        if "serve" in command and "--port" in command and command[
                command.index("--port") + 1] == port:
            for member in [process] + process.children(recursive=True):
                times = member.cpu_times()
                total += times.user + times.system
    return total


async def closed_loop(run_one, count: int, concurrency: int):
    """Runs ``count`` tasks with ``concurrency`` in flight.

    Returns:
        Each task's (result, latency), and the wall time.
    """
    indices = iter(range(count))
    outcomes: list = [None] * count

    async def worker():
        for i in indices:
            start = time.perf_counter()
            result = await run_one(i)
            outcomes[i] = (result, time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes, time.perf_counter() - start


class HttpSides:
    """The hooked server and the join on the stock server, as sides of a
    closed loop.

    Args:
        workload: The workload.
        session: The client session.
        hooked_base: The hooked server.
        stock_base: The stock server.
        max_model_len: The servers' longest sequence.
    """

    def __init__(self, workload: Workload, session, hooked_base: str,
                 stock_base: str, max_model_len: int):
        self.workload = workload
        self.session = session
        self.bases = {"hooks": hooked_base, "join": stock_base}
        self.max_model_len = max_model_len
        self.sender = HttpSender(session, stock_base, workload.model,
                                 {"temperature": 0.0})
        self.joins = 0

    async def complete(self, side: str, task: Task) -> tuple[str, int]:
        """One plain request: its text and completion tokens."""
        body = {
            "model": self.workload.model,
            "prompt": task.prompt_ids,
            "max_tokens": task.max_tokens,
            "temperature": 0.0,
            **self.workload.body_options(task)
        }
        async with self.session.post(f"{self.bases[side]}/v1/completions",
                                     json=body) as response:
            reply = await response.json()
        assert response.status == 200, reply
        return (reply["choices"][0]["text"],
                reply["usage"]["completion_tokens"])

    async def run(self, side: str, task: Task) -> tuple[str, int]:
        """One task on ``side``: its final text and requests sent."""
        if side == "hooks":
            return (await self.complete("hooks", task))[0], 1
        self.joins += 1
        result = await run_join(self.sender, f"join-{self.joins}",
                                task.prompt_ids, task.max_tokens,
                                self.workload.special_kwargs,
                                self.max_model_len, self.workload.tokenizer,
                                self.workload.join_options(task, True))
        return result.text, result.requests

    async def prefill_tokens(self, side: str) -> float:
        return await metric_value(self.session, self.bases[side],
                                  "vllm:prompt_tokens_total")


async def http_levels(sides: HttpSides, workload: Workload, k: int, levels,
                      rounds: int, block_size: int):
    """The HTTP rows: per concurrency, both sides in alternating rounds."""
    rows = []
    for position, level in enumerate(levels):
        count = max(8, 2 * level)
        stats = {name: [] for name in ("hooks", "join")}
        # CPU seconds of each side's server and of this client.
        cpu = {
            (name, who): 0.0
            for name in stats
            for who in ("server", "client")
        }
        texts = {name: {} for name in ("hooks", "join")}
        for r in range(rounds):
            tasks = [
                workload.fan_out(k, 10**5 * (r + 1) + 1000 * level + i)
                for i in range(count)
            ]
            # Alternate across levels too, so one round per level does not
            # always run the same side first.
            order = (["hooks", "join"] if
                     (r + position) % 2 == 0 else ["join", "hooks"])
            for name in order:
                before = await sides.prefill_tokens(name)
                cpu_before = (cpu_seconds(sides.bases[name]), cpu_seconds())
                outcomes, wall = await closed_loop(
                    lambda i, name=name, tasks=tasks: sides.run(
                        name, tasks[i]),
                    count,
                    level)
                cpu[name, "server"] += (cpu_seconds(sides.bases[name]) -
                                        cpu_before[0])
                cpu[name, "client"] += cpu_seconds() - cpu_before[1]
                prefill = await sides.prefill_tokens(name) - before
                stats[name].append((outcomes, wall, prefill))
                for i, ((text, _), _) in enumerate(outcomes):
                    texts[name][(r, i)] = text
        same = sum(texts["hooks"][key] == texts["join"][key]
                   for key in texts["hooks"])
        row = {
            "block_size": block_size,
            "dtype": workload.dtype,
            "k": k,
            "in_flight": level,
            "tasks": count * rounds,
            "same_texts": f"{same}/{len(texts['hooks'])}"
        }
        for name, runs in stats.items():
            latencies = [lat for outcomes, _, _ in runs for _, lat in outcomes]
            tasks_done = sum(len(outcomes) for outcomes, _, _ in runs)
            row[f"{name}_tasks_per_s"] = round(
                tasks_done / sum(wall for _, wall, _ in runs), 2)
            for q in (0.5, 0.9, 0.99):
                row[f"{name}_p{round(q * 100)}_s"] = round(
                    percentile(latencies, q), 3)
            row[f"{name}_requests_per_task"] = round(
                sum(req for outcomes, _, _ in runs
                    for (_, req), _ in outcomes) / tasks_done, 2)
            row[f"{name}_prefill_per_task"] = round(
                sum(p for _, _, p in runs) / tasks_done, 1)
            # Where each side's CPU goes, per task (a process-level
            # profile; the machine has 2 cores).
            for who in ("server", "client"):
                row[f"{name}_{who}_cpu_s_per_task"] = round(
                    cpu[name, who] / tasks_done, 3)
        row["hooks_throughput_x"] = round(
            row["hooks_tasks_per_s"] / row["join_tasks_per_s"], 2)
        row["hooks_p50_over_join"] = round(
            row["hooks_p50_s"] / row["join_p50_s"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


async def plain_rounds(sides: HttpSides, workload: Workload, rounds: int,
                       block_size: int) -> dict:
    """Plain requests on both servers, alternating: tokens per second."""
    rates = {"hooks": [], "join": []}
    count = 2 * PLAIN_CONCURRENCY
    for r in range(rounds):
        tasks = [workload.plain(10**4 * r + i) for i in range(count)]
        order = ["hooks", "join"] if r % 2 == 0 else ["join", "hooks"]
        for name in order:
            outcomes, wall = await closed_loop(
                lambda i, name=name, tasks=tasks: sides.complete(
                    name, tasks[i]),
                count,
                PLAIN_CONCURRENCY)
            rates[name].append(sum(t for (_, t), _ in outcomes) / wall)
    row = {
        "block_size": block_size,
        "dtype": workload.dtype,
        "in_flight": PLAIN_CONCURRENCY,
        "rounds": rounds,
        "hooked_server_tokens_per_s": round(statistics.median(rates["hooks"])),
        "stock_server_tokens_per_s": round(statistics.median(rates["join"])),
    }
    row["hooked_over_stock"] = round(
        row["hooked_server_tokens_per_s"] / row["stock_server_tokens_per_s"],
        3)
    # Each round's rates: the spread the ratio is to be read in.
    row["hooked_server_rounds"] = [round(rate) for rate in rates["hooks"]]
    row["stock_server_rounds"] = [round(rate) for rate in rates["join"]]
    print(json.dumps(row), flush=True)
    return row


def over_http(workload: Workload, block_size: int, args, folder: Path):
    """The HTTP and plain rows at one block size (servers started here)."""
    common = [
        "--max-model-len",
        str(workload.max_model_len), "--dtype", workload.dtype,
        "--enable-prefix-caching", "--disable-log-requests"
    ]
    if block_size:
        common += ["--block-size", str(block_size)]
    with ExitStack() as stack:
        hooked_base = stack.enter_context(
            running_server(workload.model,
                           folder / f"hooked-{block_size}.log",
                           HOOKS_JSON,
                           extra=common))
        stock_base = stack.enter_context(
            running_server(
                workload.model,
                folder / f"stock-{block_size}.log",
                None,
                extra=common +
                ["--enable-chunked-prefill", "--disable-async-output-proc"]))

        async def measure():
            async with client_session() as session:
                max_len = await server_max_model_len(session, stock_base,
                                                     workload.model)
                sides = HttpSides(workload, session, hooked_base, stock_base,
                                  max_len)
                # Warm-up: both sides, once.
                warm = workload.fan_out(2, 10**7)
                await sides.run("hooks", warm)
                await sides.run("join", warm)
                actual_block = block_size or args.default_block_size
                rows = await http_levels(sides, workload, args.http_k,
                                         args.concurrency, args.rounds,
                                         actual_block)
                plain = None
                if args.plain_rounds:
                    plain = await plain_rounds(sides, workload,
                                               args.plain_rounds, actual_block)
                return rows, plain

        return asyncio.run(measure())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_options(parser, MODEL_HELP)
    parser.add_argument("--max-model-len",
                        type=int,
                        default=1024,
                        help="with --model")
    parser.add_argument("--max-tokens",
                        type=int,
                        default=0,
                        help="each request's budget (default: 256 on a "
                        "real model, the model length on the tiny one)")
    parser.add_argument("--block-sizes",
                        type=int,
                        nargs="+",
                        default=[16, 0],
                        help="0: the platform's default")
    parser.add_argument("--default-block-size",
                        type=int,
                        default=128,
                        help="what 0 means on this platform, for the tables")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--m", type=int, default=32, help="child tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--http-k", type=int, default=4)
    parser.add_argument("--concurrency",
                        type=int,
                        nargs="+",
                        default=[1, 8, 32, 64])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--plain-rounds",
                        type=int,
                        default=4,
                        help="0: no plain requests")
    parser.add_argument("--skip-in-process", action="store_true")
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--out", default="peer_join.json")
    args = parser.parse_args()
    workload = Workload(args)
    # The checkpoint's folder name (the delta's digest), not this machine's
    # path to it.
    results: dict = {
        "model": Path(workload.model).name,
        "dtype": workload.dtype
    }
    if not args.skip_in_process:
        results["in_process"] = []
        for block_size in args.block_sizes:
            results["in_process"] += in_process(workload, block_size, args.ks,
                                                args.repeats)
            gc.collect()  # its engines
    if not args.skip_http:
        results["http"], results["plain"] = [], []
        with tempfile.TemporaryDirectory() as folder:
            for block_size in args.block_sizes:
                rows, plain = over_http(workload, block_size, args,
                                        Path(folder))
                results["http"] += rows
                if plain is not None:
                    results["plain"].append(plain)
    Path(args.out).write_text(json.dumps(results, indent=2))
    for section in ("in_process", "http", "plain"):
        if results.get(section):
            print(f"\n## {section}")
            print_table(results[section])
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
