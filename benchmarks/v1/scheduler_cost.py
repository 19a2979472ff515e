# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The V1 scheduler's own cost per step, plugin against stock, model-free.

Times `schedule()` + `update_from_output()` per engine step with 64, 256
and 1,024 running requests (`v1_batch_queue`: a real scheduler and KV
cache manager, a scripted sampler, no model), so that GPU users can set it
against their step time (10-30 ms). Sides, alternated round by round in
one run, each on the same requests:
- stock `Scheduler` (async off) and the plugin's `SequenceHookScheduler`
  with no tree (plain requests);
- stock `AsyncScheduler` and the plugin's async variant, two batches in
  flight;
- the plugin with live trees: every request has promised twice and waits
  parked at its `<sync>` while its children decode, so the running
  requests are children (the same number as the plain sides' requests).

Each round times every side's steps in wall and in this process's CPU
seconds, and divides each plugin side's by its stock side's of the same
round: the ratios reported are the median over rounds of those paired
ratios (the CPU ones leave out the time the process waits for the CPU,
which on a shared machine other work takes), with their range.

`--count-calls` instead counts the Python function calls per step of
each side (`cProfile`, the same steps): a measure of work that the
machine's noise does not move, to compare two versions of the code.

Usage: .venv-v1/bin/python benchmarks/v1/scheduler_cost.py [--out FILE]
           [--count-calls]
"""

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

from vllm_sequence_hooks.scheduler import SequenceHookScheduler

from sequence_hooks_testkit import tiny_model
from sequence_hooks_testkit.v1_batch_queue import (FILLER, BatchQueueDriver,
                                                   make_request,
                                                   make_scheduler)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

PROMPT_LEN = 32
WARMUP_STEPS = 12
TIMED_STEPS = 40
# Long enough that no request ends while steps are timed.
NEVER = 10**6


def side(model_path, ids, scheduler_cls, async_scheduling, hooks, trees,
         num_running):
    """Builds one side and runs it until every request decodes."""
    scheduler = make_scheduler(scheduler_cls,
                               model_path,
                               async_scheduling,
                               special_kwargs=hooks,
                               num_blocks=num_running * 8 + 64,
                               max_num_seqs=num_running,
                               max_model_len=512)

    def sample(request_id: str, position: int) -> int:
        if trees and "/promise-" not in request_id:
            # Two children each, then park until they end (they never do).
            return (ids.promise if position in (1, 2) else
                    ids.sync if position == 3 else FILLER)
        return FILLER if position < NEVER else ids.eos

    driver = BatchQueueDriver(scheduler,
                              sample,
                              depth=2 if async_scheduling else 1)
    # With trees, the running requests are the children: half as many
    # roots, each with two.
    roots = num_running // 2 if trees else num_running
    for i in range(roots):
        prompt = [FILLER + 1 + (i + j) % 30 for j in range(PROMPT_LEN)]
        driver.add(make_request(scheduler, f"r{i}", prompt, 400, ids.eos))
    for _ in range(WARMUP_STEPS * driver.depth):
        driver.step()
    assert len(scheduler.running) == num_running, len(scheduler.running)
    return driver


# Each plugin side and the stock side it is divided by.
PAIRS = {
    "no tree": ("plugin, no tree", "stock Scheduler"),
    "live trees": ("plugin, live trees", "stock Scheduler"),
    "async, no tree": ("plugin async, no tree", "stock AsyncScheduler"),
    "async, live trees": ("plugin async, live trees", "stock AsyncScheduler"),
}


def time_steps(driver) -> tuple[float, float]:
    """Mean wall and CPU seconds per engine step over `TIMED_STEPS`
    steps.

    What exists before is frozen out of the garbage collector: its full
    collections would otherwise scan every side's requests and land on
    whichever side set them off (a 30x slower round now and then); the
    collections of what the steps allocate stay in the time.
    """
    gc.collect()
    gc.freeze()
    steps_before = driver.steps
    wall, cpu = time.perf_counter(), time.process_time()
    while driver.steps - steps_before < TIMED_STEPS:
        driver.step()
    steps = driver.steps - steps_before
    return ((time.perf_counter() - wall) / steps,
            (time.process_time() - cpu) / steps)


def count_calls(driver) -> float:
    """Python function calls per engine step over `TIMED_STEPS` steps."""
    steps_before = driver.steps
    profile = cProfile.Profile()
    profile.enable()
    while driver.steps - steps_before < TIMED_STEPS:
        driver.step()
    profile.disable()
    return pstats.Stats(profile).total_calls / (driver.steps - steps_before)


def paired(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per pair, the median and range over rounds of plugin over stock,
    each round's plugin time divided by the same round's stock time."""
    result = {}
    for pair, (plugin, stock) in PAIRS.items():
        ratios = [p / s for p, s in zip(times[plugin], times[stock])]
        result[pair] = {
            "median": round(statistics.median(ratios), 3),
            "min": round(min(ratios), 3),
            "max": round(max(ratios), 3),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSON results")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count-calls",
                        action="store_true",
                        help="count each side's calls per step, no times")
    parser.add_argument("--running",
                        type=int,
                        nargs="+",
                        default=[64, 256, 1024])
    args = parser.parse_args()
    ids = tiny_model.tiny_hook_ids()
    model_path = tiny_model.build_tiny_model(Path(tempfile.mkdtemp()))
    hooks = {
        "sync_token_id": ids.sync,
        "promise_token_id": ids.promise,
        "child_role_token_id": ids.child,
        "max_children_per_request": 4,
    }
    sides = {
        "stock Scheduler": (Scheduler, False, None, False),
        "plugin, no tree": (SequenceHookScheduler, False, hooks, False),
        "plugin, live trees": (SequenceHookScheduler, False, hooks, True),
        "stock AsyncScheduler": (AsyncScheduler, True, None, False),
        "plugin async, no tree": (SequenceHookScheduler, True, hooks, False),
        "plugin async, live trees": (SequenceHookScheduler, True, hooks, True),
    }
    results = {}
    for num_running in args.running:
        drivers = {
            name: side(model_path, ids, *spec, num_running)
            for name, spec in sides.items()
        }
        if args.count_calls:
            results[num_running] = {
                "calls_per_step": {
                    name: round(count_calls(driver), 1)
                    for name, driver in drivers.items()
                }
            }
            print(json.dumps({num_running: results[num_running]}), flush=True)
            continue
        wall = {name: [] for name in sides}
        cpu = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, driver in drivers.items():
                seconds, cpu_seconds = time_steps(driver)
                wall[name].append(seconds)
                cpu[name].append(cpu_seconds)
        results[num_running] = {
            "ms_per_step": {
                name: round(statistics.median(t) * 1e3, 3)
                for name, t in wall.items()
            },
            "cpu_ms_per_step": {
                name: round(statistics.median(t) * 1e3, 3)
                for name, t in cpu.items()
            },
            "plugin_over_stock": paired(wall),
            "plugin_over_stock_cpu": paired(cpu),
        }
        print(json.dumps({num_running: results[num_running]}), flush=True)
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "what":
                    "schedule() + update_from_output() per step, "
                    "model-free: " +
                    ("Python function calls (cProfile)" if args.count_calls
                     else "medians of rounds; plugin over stock: median "
                     "and range over rounds of each round's ratio"),
                    "block_size":
                    16,
                    "rounds":
                    args.rounds,
                    "timed_steps":
                    TIMED_STEPS,
                    "results":
                    results
                },
                indent=2) + "\n")


if __name__ == "__main__":
    main()
