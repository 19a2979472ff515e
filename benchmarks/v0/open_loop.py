# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Open-loop mixed workload: critical-path scheduling on and off, and the
client-side join.

Requests arrive at a fixed rate, whatever the engine is doing, for a
bounded time: a mix of fan-out requests (a parent writes 8 tokens,
promises k children of m tokens, syncs, writes 8 more) and plain ones (as
many tokens as a fan-out's parent writes plus one child's m), in an order
drawn from a seed. Every sequence is scripted (hooks forced, the rest free
with special tokens masked), so every side computes the same tokens.

Three sides, each with its own engine in one process:

- critical_path and stock_order: two hooked engines that differ only in
  `SpecialKwargs.critical_path_first`;
- join: the peer client (`sequence_hooks_references.client_join`) over a
  stock engine (no `special_kwargs`; with the scheduling options hooks
  turn on). Each arrival
  starts a `JoinTask`: its parent's request samples its own promises and
  `<sync>` (the same script, no tokens for free), each `<promise>` sends a
  child request at once, and one continuation request goes out over the
  merged context. A plain arrival is a join that never promises: one
  request. A child request queues as a new arrival would; a hooked child
  inherits its parent's place.

Prefix caching is on for every side (a join relies on it; without it the
hooked sides would recompute preempted prefixes the join gets back from
the cache). `--max-num-seqs` makes running slots scarce,
`--num-gpu-blocks` (with `--block-size`) KV blocks; the stock engine gets
the same. The clock is
engine steps by default: arrivals come every 1/rate steps and latencies
are counted in steps, so the figures do not move with other load on the
machine (`--clock seconds` for wall time). The join's steps are as
comparable as the hooked sides': one engine serves all of its requests,
and the clock counts that engine's steps. Each rate in `--loads` is a
multiple of the capacity measured first on a burst of the same mix (the
two hooked sides, averaged); every side gets the same arrival schedule.
For each rate, trials alternate the sides' order (forward, then
reversed) over that schedule. A request's latency runs from its scheduled
arrival to its final output: on the join side, to the end of its last
continuation request (a plain request's only one). Reports, per side and
rate, p50/p99 latency for all requests and per kind, engine steps,
sequences per step, preemptions, how many final texts equal the critical
path side's, and the ratios stock order / critical path and join /
critical path. Prints a table and writes JSON.

Usage: .venv/bin/python benchmarks/open_loop.py [--loads 0.8 1.0 1.2]
    [--trials 2] [--max-num-seqs 8] [--block-size B --num-gpu-blocks N]
    [--clock steps|seconds] [--duration D] [--model DIR --dtype D]
    [--out open_loop.json]
"""

import argparse
import json
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

from sequence_hooks_bench.runs import add_engine_options, prepare, report
from sequence_hooks_references.client_join import EngineSender, JoinTask
from sequence_hooks_testkit.schedule_recorder import ScheduleRecorder
from sequence_hooks_testkit.scripted_hooks import ScriptedHooks

# Arrivals per trial, in each clock's unit.
DEFAULT_DURATION = {"steps": 1000.0, "seconds": 30.0}
# The hooked sides, by their `critical_path_first` setting.
SIDES = {"critical_path": True, "stock_order": False}
# The side every other is compared with.
REFERENCE = "critical_path"
# The client-side join's side.
JOIN = "join"
# The stock engine's options for the join: the scheduling options hooks
# turn on (prefix caching is on for every side).
JOIN_ENGINE_OPTIONS = {
    "enable_chunked_prefill": True,
    "disable_async_output_proc": True,
}
PROMPTS = ["the cat sees", "one two three", "big red dog", "a small bird"]
# `--model`: what it names and its default.
MODEL_HELP = ("model folder with <sync>, <promise> and <child> tokens "
              "(default: the tiny test model)")


@dataclass
class Workload:
    """The shape of the mix."""
    # Share of fan-out requests.
    fan_out_share: float
    # Children per fan-out.
    k: int
    # Tokens each child writes.
    m: int
    # Tokens a parent writes before its promises and after its merge.
    prefix: int
    suffix: int


@dataclass
class Arrival:
    """One request of the schedule."""
    # Seconds after the trial's start.
    offset: float
    request_id: str
    # "fan_out" or "plain".
    kind: str
    prompt: str


def plans_of(kind: str, workload: Workload, ids) -> dict:
    """The scripted program of a request of ``kind``."""
    w = workload
    if kind == "plain":
        return {(): [None] * (w.prefix + w.k + 1 + w.m + w.suffix)}
    plans = {
        (): [None] * w.prefix + [ids.promise] * w.k + [ids.sync] +
        [None] * w.suffix
    }
    plans.update({(i, ): [None] * w.m for i in range(w.k)})
    return plans


def arrivals(num: int, rate: float, workload: Workload,
             seed: int) -> list[Arrival]:
    """``num`` requests at a fixed ``rate`` (per second), kinds drawn from
    ``seed``."""
    rng = random.Random(seed)
    return [
        Arrival(
            i / rate, f"req-{i}",
            "fan_out" if rng.random() < workload.fan_out_share else "plain",
            PROMPTS[i % len(PROMPTS)]) for i in range(num)
    ]


class Clock:
    """The time of an open-loop run: wall seconds, or engine steps.

    In steps, arrivals and latencies do not depend on what else runs on the
    machine; an idle engine jumps to the next arrival.

    Args:
        unit: "seconds" or "steps".
    """

    def __init__(self, unit: str):
        self.unit = unit
        self.start = time.perf_counter()
        # Engine steps so far, plus the idle gaps jumped over.
        self.steps = 0.0

    def now(self) -> float:
        if self.unit == "seconds":
            return time.perf_counter() - self.start
        return self.steps

    def wait_until(self, moment: float) -> None:
        """Lets an idle engine wait for the arrival at ``moment``."""
        if self.unit == "seconds":
            time.sleep(max(0.0, moment - self.now()))
        else:
            self.steps = max(self.steps, moment)


def run_open_loop(llm,
                  schedule: list[Arrival],
                  make_params,
                  unit: str,
                  max_steps: int,
                  texts: Optional[dict[str, str]] = None) -> dict[str, float]:
    """Feeds ``schedule`` to ``llm``'s engine as time passes.

    Args:
        llm: The `LLM` to run on.
        schedule: The arrivals, by offset.
        make_params: Sampling parameters of an arrival.
        unit: The clock's unit, "seconds" or "steps".
        max_steps: Steps after which the run fails instead of hanging.
        texts: If given, filled with each request's final text.

    Returns:
        Latency per request id, from its scheduled arrival, in ``unit``.
    """
    engine = llm.llm_engine
    pending = deque(schedule)
    offsets = {arrival.request_id: arrival.offset for arrival in schedule}
    latencies: dict[str, float] = {}
    clock = Clock(unit)
    for _ in range(max_steps):
        while pending and pending[0].offset <= clock.now():
            arrival = pending.popleft()
            engine.add_request(arrival.request_id, arrival.prompt,
                               make_params(arrival))
        if not engine.has_unfinished_requests():
            if not pending:
                return latencies
            clock.wait_until(pending[0].offset)
            continue
        outputs = engine.step()
        clock.steps += 1
        for output in outputs:
            if output.finished:
                latencies[output.request_id] = (clock.now() -
                                                offsets[output.request_id])
                if texts is not None:
                    texts[output.request_id] = output.outputs[0].text
    raise RuntimeError(f"not finished after {max_steps} steps")


# Makes the join of an arrival: called with the arrival, the sender and
# the callback the task must call once done.
JoinFactory = Callable[[Arrival, EngineSender, Callable[[JoinTask], None]],
                       JoinTask]


def run_join_open_loop(
        llm,
        schedule: list[Arrival],
        make_join: JoinFactory,
        unit: str,
        max_steps: int,
        texts: Optional[dict[str, str]] = None) -> dict[str, float]:
    """Feeds ``schedule`` to the client-side join over ``llm``'s stock
    engine as time passes, with `run_open_loop`'s contract.

    Each arrival starts its join at its offset; the join then sends its
    child and continuation requests between engine steps, as a client
    would.

    Args:
        llm: The stock `LLM` to run on.
        schedule: The arrivals, by offset.
        make_join: The join of an arrival (its task id the request id).
        unit: The clock's unit, "seconds" or "steps".
        max_steps: Steps after which the run fails instead of hanging.
        texts: If given, filled with each request's final text.

    Returns:
        Latency per request id, from its scheduled arrival to the end of
        its join's last request, in ``unit``.
    """
    engine = llm.llm_engine
    sender = EngineSender(engine)
    pending = deque(schedule)
    offsets = {arrival.request_id: arrival.offset for arrival in schedule}
    latencies: dict[str, float] = {}
    # Joins started and not done; those done in the current step.
    unfinished: set[str] = set()
    done: list[JoinTask] = []
    clock = Clock(unit)
    for _ in range(max_steps):
        while pending and pending[0].offset <= clock.now():
            arrival = pending.popleft()
            unfinished.add(arrival.request_id)
            make_join(arrival, sender, done.append).start()
        if not unfinished:
            if not pending:
                return latencies
            clock.wait_until(pending[0].offset)
            continue
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"joins {sorted(unfinished)} stalled")
        sender.step()
        clock.steps += 1
        for task in done:
            if task.error is not None:
                raise RuntimeError(f"join {task.task_id} failed") from (
                    task.error)
            latencies[task.task_id] = clock.now() - offsets[task.task_id]
            unfinished.discard(task.task_id)
            if texts is not None:
                texts[task.task_id] = task.result.text
        done.clear()
    raise RuntimeError(f"not finished after {max_steps} steps")


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def hook_setup(args, workload: Workload):
    """The model folder, its hook token ids, the engines' arguments per
    side and the join's hook configuration."""
    from vllm.config import SpecialKwargs
    max_len = (64 + workload.prefix + workload.k * (workload.m + 2) +
               workload.suffix)
    if args.model:
        from transformers import AutoTokenizer
        model = args.model
        tokenizer = AutoTokenizer.from_pretrained(model)
        ids = argparse.Namespace(**{
            role:
            tokenizer.convert_tokens_to_ids(f"<{role}>")
            for role in ("sync", "promise", "child")
        },
                                 eos=tokenizer.eos_token_id)
    else:
        ids, _, model = prepare(max_positions=max_len)
    engine_args = {
        "dtype": args.dtype,
        "max_model_len": max_len,
        "max_num_seqs": args.max_num_seqs,
        # On for every side: the join relies on it, and a hooked engine
        # with it recomputes a preempted sequence's cached blocks no more
        # than the join does.
        "enable_prefix_caching": True,
    }
    if args.block_size:
        engine_args["block_size"] = args.block_size
    if args.num_gpu_blocks:
        engine_args["num_gpu_blocks_override"] = args.num_gpu_blocks
    hooks = {
        "sync_token_id": ids.sync,
        "promise_token_id": ids.promise,
        "child_role_token_id": ids.child,
    }
    sides = {
        side: {
            **engine_args, "special_kwargs":
            SpecialKwargs(**hooks, critical_path_first=on)
        }
        for side, on in SIDES.items()
    }
    sides[JOIN] = {**engine_args, **JOIN_ENGINE_OPTIONS}
    return model, ids, sides, SpecialKwargs(**hooks)


def summary(samples: list[tuple[str, float]]) -> dict:
    """p50/p99 latency in seconds of (kind, latency) samples, for all
    requests and per kind."""
    row = {}
    for kind in ("all", "fan_out", "plain"):
        values = [
            latency for sample_kind, latency in samples
            if kind in ("all", sample_kind)
        ]
        for q in (50, 99):
            row[f"{kind}_p{q}"] = (round(percentile(values, q / 100), 3)
                                   if values else None)
    return row


def count_step(counts: list[int], outputs) -> None:
    """Adds a step and the groups it scheduled to ``counts``."""
    counts[0] += 1
    counts[1] += len(outputs.scheduled_seq_groups)


def run(args) -> None:
    """Calibrates the rate, runs the trials, reports."""
    unit = args.clock[:-1]
    from sequence_hooks_testkit.engines import tiny_llm
    from vllm import SamplingParams
    workload = Workload(args.fan_out_share, args.k, args.m, 8, 8)
    model, ids, side_args, join_hooks = hook_setup(args, workload)
    masked = [ids.sync, ids.promise, ids.child, ids.eos]
    max_len = side_args[REFERENCE]["max_model_len"]
    max_tokens = max_len - 16

    def script(arrival: Arrival, **fixed) -> ScriptedHooks:
        return ScriptedHooks(plans_of(arrival.kind, workload, ids),
                             promise_id=ids.promise,
                             child_id=ids.child,
                             eos_id=ids.eos,
                             masked_ids=masked,
                             **fixed)

    def make_params(arrival: Arrival) -> SamplingParams:
        return SamplingParams(temperature=0.0,
                              max_tokens=max_tokens,
                              logits_processors=[script(arrival)])

    llms = {
        side: tiny_llm(model, **engine_args)
        for side, engine_args in side_args.items()
    }
    tokenizer = llms[JOIN].get_tokenizer()

    def make_join(arrival: Arrival, sender: EngineSender, on_done) -> JoinTask:
        # A stock engine cannot tell a segment's role and plan step from
        # its context: each request's script starts where the client is.
        return JoinTask(
            arrival.request_id,
            tokenizer.encode(arrival.prompt),
            max_tokens,
            join_hooks,
            max_len,
            tokenizer,
            sender,
            options=lambda role, step: {
                "temperature": 0.0,
                "logits_processors": [script(arrival, role=role, step=step)],
            },
            on_done=on_done)

    runners = {
        side: partial(run_open_loop, llms[side], make_params=make_params)
        for side in SIDES
    }
    runners[JOIN] = partial(run_join_open_loop,
                            llms[JOIN],
                            make_join=make_join)
    block_size = llms[REFERENCE].llm_engine.cache_config.block_size

    # Capacity: a burst of the same mix, all at once, on each hooked side.
    burst_size = 4 * args.max_num_seqs
    capacities = []
    for side in SIDES:
        burst = arrivals(burst_size, float("inf"), workload, args.seed)
        for arrival in burst:
            arrival.request_id = f"burst-{side}-{arrival.request_id}"
        latencies = runners[side](schedule=burst,
                                  unit=args.clock,
                                  max_steps=200000)
        capacities.append(burst_size / max(latencies.values()))
    capacity = statistics.mean(capacities)
    print(f"capacity {capacity:.4f} requests per {unit}", flush=True)
    duration = args.duration or DEFAULT_DURATION[args.clock]
    rows = []
    for load in args.loads:
        rate = load * capacity
        schedule = arrivals(max(1, int(rate * duration)), rate, workload,
                            args.seed)
        setting = {
            "dtype": args.dtype,
            "block_size": block_size,
            "max_num_seqs": args.max_num_seqs,
            "clock": args.clock,
            "load": load,
            f"rate_per_{unit}": round(rate, 4),
        }
        rows += compare(llms, runners, schedule, args, setting)
    report(rows, args.out)


def compare(llms, runners, schedule: list[Arrival], args,
            setting: dict) -> list[dict]:
    """Runs ``schedule`` on every side, alternating, ``args.trials`` times.

    Args:
        llms: The `LLM` of each side.
        runners: Each side's open-loop driver, called with ``schedule``,
            ``unit``, ``max_steps`` and ``texts`` (see `run_open_loop`).
        schedule: The arrivals.
        args: The command line.
        setting: The columns that name the setting.

    Returns:
        A row per side, then a row of ratios side / critical path for each
        other side.
    """
    max_steps = 200000
    per_side: dict[str, list[tuple[str, float]]] = {side: [] for side in llms}
    preemptions = {side: 0 for side in llms}
    # Engine steps and groups scheduled in them, per side.
    steps = {side: [0, 0] for side in llms}
    # Final texts equal to the reference side's, per side.
    same_texts = {side: 0 for side in llms}
    for trial in range(args.trials):
        # Each side goes first in every other trial (ABBA for two).
        order = list(llms) if trial % 2 == 0 else list(reversed(llms))
        texts: dict[str, dict[str, str]] = {}
        for side in order:
            scheduler = llms[side].llm_engine.scheduler[0]
            before = scheduler.num_cumulative_preemption
            trial_schedule = [
                Arrival(a.offset, f"{setting['load']}-{trial}-{a.request_id}",
                        a.kind, a.prompt) for a in schedule
            ]
            texts[side] = {}
            with ScheduleRecorder(scheduler, partial(count_step, steps[side])):
                latencies = runners[side](schedule=trial_schedule,
                                          unit=args.clock,
                                          max_steps=max_steps,
                                          texts=texts[side])
            preemptions[side] += scheduler.num_cumulative_preemption - before
            samples = [(a.kind, latencies[a.request_id])
                       for a in trial_schedule]
            per_side[side] += samples
            print(
                f"load {setting['load']} trial {trial} {side}: "
                f"{json.dumps(summary(samples))}",
                flush=True)
        for side, side_texts in texts.items():
            same_texts[side] += sum(text == texts[REFERENCE][request_id]
                                    for request_id, text in side_texts.items())
    rows = {}
    for side, samples in per_side.items():
        same = ("-"
                if side == REFERENCE else f"{same_texts[side]}/{len(samples)}")
        rows[side] = {
            "side": side,
            **setting, "requests": len(samples),
            "same_texts": same,
            "preemptions": preemptions[side],
            "steps": steps[side][0],
            "seqs_per_step": round(steps[side][1] / steps[side][0], 2),
            **summary(samples)
        }
    reference = rows[REFERENCE]
    ratio_rows = []
    for side, row in rows.items():
        if side == REFERENCE:
            continue
        ratios = {
            key:
            round(row[key] /
                  reference[key], 2) if reference[key] and row[key] else None
            for key in reference
            if key.endswith(("_p50", "_p99")) or key == "steps"
        }
        ratio_rows.append({
            **{
                key: ""
                for key in reference
            },
            **setting, "side": f"{side} / {REFERENCE}",
            **ratios
        })
    return list(rows.values()) + ratio_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_options(parser, MODEL_HELP)
    parser.add_argument("--block-size",
                        type=int,
                        help="KV block size (default: the platform's)")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--num-gpu-blocks",
                        type=int,
                        help="KV blocks (default: what the KV cache space "
                        "gives), to make blocks scarce")
    parser.add_argument("--clock",
                        choices=list(DEFAULT_DURATION),
                        default="steps",
                        help="time arrivals and latencies in engine steps "
                        "(not moved by other load on the machine) or in "
                        "wall seconds")
    parser.add_argument("--duration",
                        type=float,
                        help="time of arrivals per trial, in the clock's "
                        "unit (default: 30 seconds or 1000 steps)")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--loads",
                        type=float,
                        nargs="+",
                        default=[0.8, 1.0, 1.2],
                        help="arrival rates, as shares of the capacity "
                        "measured on a burst")
    parser.add_argument("--fan-out-share", type=float, default=0.5)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--m", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="open_loop.json")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
