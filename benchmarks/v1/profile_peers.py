# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where a server's time goes: the V1 plugin against the join.

`http_peers.py` finds the plugin's throughput below what the prefill it
saves allows (85-99 % of the priced limit). This profiles one of its cells: the
plugin's server running the hooked side and the same stock server
running the client-side join, on the same tasks, alternating, each
server's whole process tree (API server, engine core, model worker)
sampled by py-spy (`--subprocesses --nonblocking`, the same rate on
both; idle threads are not sampled, so a sample is CPU busy) while its
side runs. Per side and process it prints the busy seconds per task,
split by what the stack holds (the first part whose frame it holds, in
`PARTS`' order: the plugin's own frames, spinning on the shared-memory
queue between engine core and worker, the scheduler's `schedule` and
`update_from_output`, the worker's model execution and sampling,
detokenization, the rest); and the functions whose busy time per task
differs most between the sides.

Usage: .venv-v1/bin/python benchmarks/v1/profile_peers.py [--k 2]
    [--in-flight 32] [--block-size 0] [--rounds 2]
    [--out benchmarks/v1/results/profile_peers.json]
"""

import argparse
import asyncio
import collections
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# yapf conflicts with isort for this block
# yapf: disable
from sequence_hooks_bench.http_sides import (Sides, Workload, measured_run,
                                             one_cell_run, running_servers,
                                             same_texts, server_block_size,
                                             write_one_cell_run)
from sequence_hooks_references.client_join_http import client_session

# yapf: enable

RESULTS = Path(__file__).resolve().parent / "results" / "profile_peers.json"
# Side: its server.
SIDES = {"hooks_v1": "plugin", "join_v1": "stock"}
# Parts of a process's busy time, by a frame the stack holds (the first
# that matches, in this order).
PARTS = (
    ("plugin", "vllm_sequence_hooks"),
    ("spin-waiting on the message queue", "MessageQueue.dequeue ("),
    ("schedule", "schedule (vllm/v1/core/sched/"),
    ("update_from_output", "update_from_output (vllm/v1/core/sched/"),
    ("model execution", "execute_model ("),
    ("sampling", "sample_tokens ("),
    ("detokenization", "detokeniz"),
)
RATE = 250


def function_of(frame: str) -> str:
    """A raw frame "name (file:line)" without its line."""
    return frame.rsplit(":", 1)[0] + ")" if ":" in frame else frame


def process_of(frames: list[str]) -> str:
    """The role of the process a sample is from (its innermost "process
    PID:cmdline" frame)."""
    command = [f for f in frames if f.startswith("process ")][-1]
    if "EngineCore" in command:
        return "engine core"
    if " serve " in command:
        return "API server"
    return "worker" if "Worker" in command else command.split(":", 1)[1]


def parse(path: Path) -> tuple[collections.Counter, collections.Counter]:
    """A py-spy raw profile's samples by (process, part) and by (process,
    innermost function): where the time is spent, and by whom."""
    parts: collections.Counter = collections.Counter()
    leaves: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        samples = int(count)
        frames = stack.split(";")
        process = process_of(frames)
        # The process frames hold command lines, which name the plugin.
        code = ";".join(f for f in frames if not f.startswith("process "))
        part = next((name for name, marker in PARTS if marker in code),
                    "other")
        parts[process, part] += samples
        leaves[process, function_of(frames[-1])] += samples
    return parts, leaves


async def profiled(sides: Sides, side: str, prompts: list[list[int]],
                   in_flight: int, py_spy: str, folder: Path) -> dict:
    """`http_sides.measured_run` of ``side`` with its server sampled."""
    server = sides.servers[SIDES[side]]
    out = folder / f"{side}-{time.time_ns()}.txt"
    spy = subprocess.Popen([
        py_spy, "record", "--pid",
        str(server.process.pid), "--subprocesses", "--rate",
        str(RATE), "--nonblocking", "--format", "raw", "--output",
        str(out)
    ],
                           stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    # py-spy attaches within a second; a side must not start unsampled.
    await asyncio.sleep(2)
    run = await measured_run(sides, side, prompts, in_flight)
    spy.send_signal(signal.SIGINT)
    spy.wait(timeout=60)
    run["parts"], run["leaves"] = parse(out)
    return run


def side_profile(runs: list[dict]) -> dict:
    """A side's busy seconds per task by process, in all and by part, and
    by process and innermost function."""
    tasks = sum(len(r["outcomes"]) for r in runs)
    parts: collections.Counter = sum((r["parts"] for r in runs),
                                     collections.Counter())
    leaves: collections.Counter = sum((r["leaves"] for r in runs),
                                      collections.Counter())
    busy: dict[str, dict] = {}
    for (process, part), samples in sorted(parts.items()):
        entry = busy.setdefault(process, {"s_per_task": 0.0, "parts": {}})
        entry["s_per_task"] += samples / RATE / tasks
        entry["parts"][part] = round(samples / RATE / tasks, 4)
    for entry in busy.values():
        entry["s_per_task"] = round(entry["s_per_task"], 4)
    return {
        "tasks": tasks,
        "wall_s_per_task": round(sum(r["wall"] for r in runs) / tasks, 4),
        "server_cpu_s_per_task": round(sum(r["cpu"] for r in runs) / tasks, 4),
        "busy_s_per_task": busy,
        "leaves_s_per_task": {
            f"{process}: {function}": samples / RATE / tasks
            for (process, function), samples in leaves.items()
        },
    }


def worker_limit(profiles: dict) -> dict:
    """The hooks/join throughput ratio if the hooks saved only the model
    worker's busy time the join spends beyond theirs (what the engine
    computes, measured rather than priced), and the measured ratio's share
    of it."""
    hooks, join = (profiles[side] for side in SIDES)
    saved = (join["busy_s_per_task"]["worker"]["s_per_task"] -
             hooks["busy_s_per_task"]["worker"]["s_per_task"])
    limit = join["wall_s_per_task"] / (join["wall_s_per_task"] - saved)
    measured = join["wall_s_per_task"] / hooks["wall_s_per_task"]
    return {
        "hooks_over_join_throughput": round(measured, 3),
        "worker_s_saved_per_task": round(saved, 4),
        "limit_from_worker_time": round(limit, 3),
        "measured_over_that_limit": round(measured / limit, 3),
    }


async def run(servers, workload: Workload, args, folder: Path) -> dict:
    """The profiled rounds on the running servers."""
    async with client_session() as session:
        sides = Sides(workload, session, servers, args.max_model_len)
        block = await server_block_size(session, servers["stock"])
        warm = workload.prompt(args.k, 0, True)
        for side in SIDES:
            await sides.run(side, warm)
        runs: dict[str, list[dict]] = {side: [] for side in SIDES}
        for r in range(args.rounds):
            base = 10**8 * (r + 1) + 10**4 * args.k
            prompts = [
                workload.prompt(args.k, base + i, True)
                for i in range(2 * args.in_flight)
            ]
            order = list(SIDES)[::1 if r % 2 == 0 else -1]
            for side in order:
                runs[side].append(await profiled(sides, side, prompts,
                                                 args.in_flight, args.py_spy,
                                                 folder))
                print(f"round {r + 1}: {side} done", flush=True)
    profiles = {
        side: side_profile(side_runs)
        for side, side_runs in runs.items()
    }
    hooks, join = (profiles[s]["leaves_s_per_task"] for s in SIDES)
    differences = sorted(set(hooks) | set(join),
                         key=lambda f: -abs(hooks.get(f, 0) - join.get(f, 0)))
    for side in SIDES:
        profiles[side].pop("leaves_s_per_task")
    return {
        **worker_limit(profiles),
        "block_size":
        block,
        "same_texts":
        same_texts(runs, *SIDES),
        "profiles":
        profiles,
        "largest_differences_s_per_task": [{
            "function":
            f,
            "hooks_v1":
            round(hooks.get(f, 0), 4),
            "join_v1":
            round(join.get(f, 0), 4),
        } for f in differences[:25]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--py-spy",
                        default=str(Path(sys.executable).with_name("py-spy")))
    args, workload, meta = one_cell_run(parser, k=2, rounds=2, out=RESULTS)
    meta["rate_hz"] = RATE
    with tempfile.TemporaryDirectory() as folder, running_servers(
            args, args.block_size, Path(folder),
            tuple(SIDES.values())) as servers:
        result = asyncio.run(run(servers, workload, args, Path(folder)))
    write_one_cell_run(args, meta, result)
    print(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
