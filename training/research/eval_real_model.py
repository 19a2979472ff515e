# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Measures the real promise/sync model on held-out countries (greedy).

Through the hooked V0 engine (fp32), on tasks drawn from countries that
training never saw, it compares three ways to get the capitals:

- parallel: the fine-tuned model with the parallel system prompt; it must
  promise one child per country;
- sequential: the same model and tasks with the sequential system prompt;
- base: the untouched base model (hook tokens banned), asked about each
  country on its own ("What is the capital of X?").

A country counts as answered when the conclusion's list gives its capital
exactly (parallel, sequential), or when the base's reply contains the
capital as a whole phrase (lenient to the base). For the two forms it also
reports the accuracy of the item sentences alone (the sentence about the
country gives its capital exactly), which separates what the model knows
from how well its conclusion copies it, the texts cut at the token limit
(a sentence repeated until then leaves no conclusion), and the countries
only one form gets right, with a sign test. Prints a JSON report.

Usage: .venv/bin/python training/research/eval_real_model.py [--tasks 56]
    [--seeds 1000 3000 4000] [--confusable]
    [--model CHECKPOINT | --delta DIR]
    .venv-v1/bin/python training/research/eval_real_model.py --engine v1 ...
"""

import argparse
import json
import os
import random
import re
import time
from math import comb
from pathlib import Path
from typing import Optional

import torch

from sequence_hooks_training import capitals_task as task
from sequence_hooks_training import prepare_base_model as prepare

MAX_MODEL_LEN = 512
MAX_TOKENS = 320
# Tasks generated together.
BATCH = 28


def load(model: Path, hooks: bool = True, engine: str = "v0"):
    """A real-model engine as the model card measures it: fp32, eager.

    Args:
        model: A checkpoint folder.
        hooks: Whether `<promise>`/`<sync>`/`<child>` act as hooks.
        engine: "v0" (the fork, in .venv) or "v1" (stock vLLM with the
            plugin, in .venv-v1).

    Returns:
        The `LLM`.
    """
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    engine_args = dict(model=str(model),
                       max_model_len=MAX_MODEL_LEN,
                       enforce_eager=True,
                       dtype="float32",
                       seed=0)
    special = dict(sync_token=task.SYNC,
                   promise_token=task.PROMISE,
                   child_role_token=task.CHILD)
    if engine == "v1":
        from vllm_sequence_hooks import hooked_engine_args
        return LLM(**engine_args,
                   **(hooked_engine_args(special) if hooks else {}))
    os.environ.setdefault("VLLM_USE_V1", "0")
    from vllm.config import SpecialKwargs
    return LLM(**engine_args,
               special_kwargs=SpecialKwargs(**special) if hooks else None)


def tree_of(output):
    """A request's promise tree on either engine (None if it has none)."""
    tree = getattr(output, "promise_tree", None)
    if tree is None and getattr(output, "kv_transfer_params", None):
        from vllm_sequence_hooks import promise_tree
        tree = promise_tree(output)
    return tree


def chat_prompt(llm, messages: list[dict]) -> dict:
    """The chat-templated prompt as token ids (text would get a 2nd BOS
    with some tokenizers; ids are what training used)."""
    # (transformers 5, the V1 venv's, returns a dict unless told not to.)
    ids = llm.get_tokenizer().apply_chat_template(messages,
                                                  add_generation_prompt=True,
                                                  return_dict=False)
    return {"prompt_token_ids": ids}


def held_out_tasks(num_tasks: int,
                   seed: int,
                   confusable: bool = False,
                   countries: Optional[list[str]] = None) -> list[task.Task]:
    """Parallel tasks over held-out countries, sizes 2 to 8 in turn.

    Args:
        num_tasks: How many.
        seed: The seed of their draw.
        confusable: Whether each task holds a pair of held-out countries
            that share a word (`Guinea`, `Guinea-Bissau`).
        countries: The countries to draw from; all held-out ones if None.

    Returns:
        The tasks.
    """
    rng = random.Random(seed)
    countries = countries or task.HELD_OUT_COUNTRIES
    sizes = range(task.MIN_ITEMS, task.MAX_ITEMS + 1)
    pairs = task.confusable_pairs(countries) if confusable else None
    return [
        task.make_task(rng, countries, True, sizes[i % len(sizes)], pairs)
        for i in range(num_tasks)
    ]


def run_form(llm, tasks: list[task.Task]) -> dict:
    """Generates ``tasks`` (in batches) and scores them.

    Args:
        llm: The hooked engine over the fine-tuned model.
        tasks: The tasks, all parallel or all sequential.

    Returns:
        Per-country accuracy (of the conclusion, and of the item sentences
        alone), share of tasks with every country right, number of
        texts cut at the token limit (per task too), the mean critical path
        (`PromiseNode.critical_path`; a text without a tree: its tokens),
        share of tasks that spawned one child per country (parallel), share
        whose children each wrote their own country's sentence (parallel),
        wall time, and up to three failures.
    """
    from vllm import SamplingParams
    start = time.monotonic()
    outputs = []
    # In batches: all tasks at once overflow the 1 GiB KV cache and the
    # engine spends its time on preemption.
    prompts = [chat_prompt(llm, task.messages_of(t)) for t in tasks]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for first in range(0, len(tasks), BATCH):
        outputs += llm.generate(prompts[first:first + BATCH],
                                greedy,
                                use_tqdm=False)
    seconds = time.monotonic() - start
    correct = solved = spawned = own_item = sentences = cut = 0
    failures, per_task, paths = [], [], []
    for t, output in zip(tasks, outputs):
        text = output.outputs[0].text
        right = task.answers_correct(t, text)
        correct += sum(right)
        solved += all(right)
        said = task.sentences_correct(t, text)
        sentences += sum(said)
        tree = tree_of(output)
        children = tree.children if tree else []
        # Decoding steps on the longest chain (all of them without a tree).
        paths.append(
            tree.critical_path if tree else len(output.outputs[0].token_ids))
        spawned += len(children) == len(t.countries)
        # A text that ends at the token limit (a sentence repeated over
        # and over, as a rule) has no conclusion.
        was_cut = output.outputs[0].finish_reason == "length"
        cut += was_cut
        per_task.append({
            "cut_at_token_limit":
            was_cut,
            "conclusion":
            sum(right),
            "conclusion_per_country":
            right,
            "sentences":
            sum(said),
            "one_child_per_country":
            len(children) == len(t.countries)
        })
        own_item += len(children) == len(t.countries) and all(
            (task.parse_sentence(c.text) or ("", ))[0] == country
            for c, country in zip(children, t.countries))
        if not all(right) and len(failures) < 3:
            failures.append({"countries": t.countries, "text": text})
    report = {
        "tasks":
        len(tasks),
        "countries":
        sum(len(t.countries) for t in tasks),
        "accuracy_per_country":
        correct / sum(len(t.countries) for t in tasks),
        "sentence_accuracy_per_country":
        sentences / sum(len(t.countries) for t in tasks),
        "tasks_all_correct":
        solved / len(tasks),
        "tasks_cut_at_token_limit":
        cut,
        "mean_critical_path":
        round(sum(paths) / len(paths), 1),
        "seconds":
        round(seconds, 1),
        "failures":
        failures,
        "per_task":
        per_task,
    }
    if tasks[0].parallel:
        report["spawned_one_child_per_country"] = spawned / len(tasks)
        report["children_wrote_their_own_country"] = own_item / len(tasks)
    return report


class BanTokens:
    """Logits processor that keeps the base from sampling the hook tokens,
    which are not part of the original model."""

    def __init__(self, token_ids: list[int]):
        # The banned ids.
        self.token_ids = token_ids

    def __call__(self, output_ids, logits):
        logits[self.token_ids] = -float("inf")
        return logits


def base_knows(llm, countries: list[str]) -> list[bool]:
    """Asks the base model about each of ``countries`` on its own.

    Args:
        llm: An engine over the base checkpoint (hooks off).
        countries: The countries to ask about.

    Returns:
        Per country, whether the reply contains its capital as a whole
        phrase (lenient to the base).
    """
    from vllm import SamplingParams
    tokenizer = llm.get_tokenizer()
    banned = tokenizer.convert_tokens_to_ids(
        [task.PROMISE, task.SYNC, task.CHILD])
    outputs = llm.generate([
        chat_prompt(llm, [{
            "role": "user",
            "content": f"What is the capital of {c}?"
        }]) for c in countries
    ],
                           SamplingParams(
                               temperature=0.0,
                               max_tokens=48,
                               logits_processors=[BanTokens(banned)]),
                           use_tqdm=False)
    return [
        re.search(rf"\b{re.escape(task.CAPITALS[c])}\b", o.outputs[0].text)
        is not None for c, o in zip(countries, outputs)
    ]


def run_base(llm, tasks: list[task.Task]) -> dict:
    """Asks the base model about each country of ``tasks`` on its own.

    Args:
        llm: An engine over the base checkpoint (hooks off).
        tasks: The tasks whose countries to ask about.

    Returns:
        Per-country accuracy (reply contains the capital).
    """
    countries = [c for t in tasks for c in t.countries]
    right = base_knows(llm, countries)
    return {
        "countries": len(countries),
        "accuracy_per_country": sum(right) / len(countries),
    }


def where_spawned_in_full(tasks: list[task.Task], report: dict) -> dict:
    """Both forms' right answers, counted only over the tasks whose
    parallel parent promised one child per country: what the children
    know, apart from the parent's failures to spawn.

    Args:
        tasks: The parallel tasks, in the report's order.
        report: The parallel and sequential forms' reports.

    Returns:
        Tasks and countries counted, and per form the countries right in
        the conclusion and in the item sentences.
    """
    full = [
        i for i, row in enumerate(report["parallel"]["per_task"])
        if row["one_child_per_country"]
    ]
    counts = {
        "tasks": len(full),
        "countries": sum(len(tasks[i].countries) for i in full)
    }
    for form in ("parallel", "sequential"):
        rows = report[form]["per_task"]
        for kind in ("conclusion", "sentences"):
            counts[f"{form}_{kind}_right"] = sum(rows[i][kind] for i in full)
    return counts


def paired(report: dict) -> dict:
    """The countries one form gets right in its conclusion and the other
    does not (same tasks, same countries): what tells the forms apart.
    With ``a`` and ``b`` such countries, an exact two-sided sign test
    (McNemar's) gives how likely so uneven a split is if the forms are
    equally good.

    Args:
        report: The parallel and sequential forms' reports.

    Returns:
        The counts each way and the test's p-value.
    """
    pairs = [
        pair for p, s in zip(report["parallel"]["per_task"],
                             report["sequential"]["per_task"]) for pair in
        zip(p["conclusion_per_country"], s["conclusion_per_country"])
    ]
    only_parallel = sum(p and not s for p, s in pairs)
    only_sequential = sum(s and not p for p, s in pairs)
    return {
        "only_parallel_right": only_parallel,
        "only_sequential_right": only_sequential,
        "sign_test_p": sign_test_p(only_parallel, only_sequential)
    }


def sign_test_p(wins: int, losses: int) -> float:
    """The exact two-sided sign test: how likely a split at least as
    uneven as ``wins`` to ``losses`` is if either side is equally likely
    to win each (ties left out beforehand).

    Args:
        wins: The cases one side wins.
        losses: The cases the other side wins.

    Returns:
        The p-value, rounded to three places.
    """
    n, low = wins + losses, min(wins, losses)
    tail = sum(comb(n, i) for i in range(low + 1)) / 2**n
    return round(min(1.0, 2 * tail), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=56)
    parser.add_argument("--seeds",
                        type=int,
                        nargs="+",
                        default=[1000, 3000, 4000],
                        help="draw --tasks tasks from each seed")
    parser.add_argument("--confusable",
                        action="store_true",
                        help="every task holds two countries that share a "
                        "word (the names a parent confuses most)")
    parser.add_argument("--model",
                        help="the fine-tuned checkpoint (default: set-up's)")
    parser.add_argument("--delta",
                        help="a delta folder as the training script writes "
                        "it, merged into the base first (default: the "
                        "committed one)")
    parser.add_argument("--countries",
                        nargs="+",
                        choices=task.HELD_OUT_COUNTRIES,
                        metavar="COUNTRY",
                        help="draw the tasks from these held-out countries "
                        "only (default: all of them)")
    parser.add_argument("--engine",
                        choices=("v0", "v1"),
                        default="v0",
                        help="v1: stock vLLM with the plugin (run it with "
                        ".venv-v1/bin/python); the two forms only, the "
                        "base's row is the engine's own")
    args = parser.parse_args()
    tasks = [
        t for seed in args.seeds for t in held_out_tasks(
            args.tasks, seed, args.confusable, args.countries)
    ]
    sequential = [task.Task(t.countries, False) for t in tasks]
    model = (
        Path(args.model) if args.model else
        prepare.merge_delta(Path(args.delta) if args.delta else prepare.DELTA))
    llm = load(model, engine=args.engine)
    report = {
        "model": model.name,
        "engine": args.engine,
        "kv_block_size": llm.llm_engine.vllm_config.cache_config.block_size,
        # What the tasks are drawn with (`held_out_tasks`).
        "seeds": args.seeds,
        "tasks_per_seed": args.tasks,
        "confusable": args.confusable,
        "countries": args.countries or "held-out",
        "parallel": run_form(llm, tasks),
        "sequential": run_form(llm, sequential),
    }
    report["paired_conclusions"] = paired(report)
    report["where_parallel_spawned_one_child_per_country"] = (
        where_spawned_in_full(tasks, report))
    del llm
    import gc
    gc.collect()
    if args.engine == "v1":
        print(json.dumps(report, indent=2))
        return
    report["base"] = run_base(load(prepare.prepare_base(), hooks=False), tasks)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
