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

Usage: .venv-v1/bin/python benchmarks/v1/scheduler_cost.py [--out FILE]
"""

import argparse
import json
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


def time_steps(driver) -> float:
    """Mean seconds per engine step over `TIMED_STEPS` steps."""
    steps_before = driver.steps
    start = time.perf_counter()
    while driver.steps - steps_before < TIMED_STEPS:
        driver.step()
    return (time.perf_counter() - start) / (driver.steps - steps_before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSON results")
    parser.add_argument("--rounds", type=int, default=5)
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
        times = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, driver in drivers.items():
                times[name].append(time_steps(driver))
        medians = {name: statistics.median(t) for name, t in times.items()}
        results[num_running] = {
            "ms_per_step": {
                name: round(m * 1e3, 3)
                for name, m in medians.items()
            },
            "plugin_over_stock": {
                "no tree":
                round(medians["plugin, no tree"] / medians["stock Scheduler"],
                      3),
                "live trees":
                round(
                    medians["plugin, live trees"] / medians["stock Scheduler"],
                    3),
                "async, no tree":
                round(
                    medians["plugin async, no tree"] /
                    medians["stock AsyncScheduler"], 3),
                "async, live trees":
                round(
                    medians["plugin async, live trees"] /
                    medians["stock AsyncScheduler"], 3),
            },
        }
        print(json.dumps({num_running: results[num_running]}), flush=True)
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "what": "schedule() + update_from_output() per step, "
                    "model-free, median of rounds",
                    "block_size": 16,
                    "rounds": args.rounds,
                    "timed_steps": TIMED_STEPS,
                    "results": results
                },
                indent=2) + "\n")


if __name__ == "__main__":
    main()
