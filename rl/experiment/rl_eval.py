# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The three-arm experiment's evaluation (docs/rl.md): one checkpoint,
greedy, every task of `rl_experiment.evaluation_tasks` in one `generate`
call through the hooked V1 engine (fp32, the plugin on vLLM 0.31), so
that many trees are in flight at once. Writes one result row per task.

A row: ``right`` and ``sentences`` (per country, 1 if the conclusion,
resp. the item sentence, gives its capital exactly), ``children`` (the
root's), ``cut`` (ended by the token limit), ``critical_path`` (decoding
steps, `PromiseNode.critical_path`; a text with no tree: its tokens) and
``tokens`` (sampled tokens over every node).

It also keeps the common token set's trees: the first
`rl_token_scores.COMMON_TASKS` tasks of each half and form, every node's
tokens (`rl_token_scores.compact_tree`); the starting model's are the set
every checkpoint's entropy and KL are scored on.

Run in its own process (`rl_capitals.py` does): a second engine in the
trainer's process would compute wrong logits.

Usage (in `.venv-rl`):
    python rl/experiment/rl_eval.py --model CHECKPOINT --out RESULTS.json
    # what a checkpoint writes: the first 2 tasks of each half and form
    python rl/experiment/rl_eval.py --model CHECKPOINT --out TEXTS.json \
        --tasks 2 --texts
"""

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

# Before vLLM is imported: no hub access; the evaluation's own KV cache
# (GiB), whatever its caller's (the trainer's is 1).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "2"
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

import rl_experiment as experiment  # noqa: E402
import rl_token_scores as token_scores  # noqa: E402
from vllm_sequence_hooks import hooked_engine_args, promise_tree  # noqa: E402

from sequence_hooks_training import capitals_task as task  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402


def sampled_tokens(node) -> int:
    """Tokens the engine sampled in a tree: every node's own, not the
    ones its merges appended."""
    return len(node.token_ids) - node.num_merged_tokens + sum(
        sampled_tokens(child) for child in node.children)


def result_row(countries: list[str], output, with_text: bool) -> dict:
    """One task's result from the engine's output.

    Args:
        countries: The task's countries.
        output: Its `RequestOutput`.
        with_text: Add ``text``, the root's final text.

    Returns:
        The row described in the module's docstring.
    """
    completion = output.outputs[0]
    checked = task.Task(tuple(countries), True)
    tree = promise_tree(output)
    tokens = len(completion.token_ids)
    row = {
        "right":
        [int(ok) for ok in task.answers_correct(checked, completion.text)],
        "sentences":
        [int(ok) for ok in task.sentences_correct(checked, completion.text)],
        "children":
        len(tree.children) if tree else 0,
        "cut":
        completion.finish_reason == "length",
        "critical_path":
        tree.critical_path if tree else tokens,
        "tokens":
        sampled_tokens(tree) if tree else tokens,
    }
    if with_text:
        row["text"] = completion.text
    return row


def evaluate(model: Path, num_tasks: int, with_texts: bool = False) -> dict:
    """Runs every evaluation task of ``model`` in one `generate` call.

    Args:
        model: A checkpoint folder (fp32).
        num_tasks: Tasks per half and form (the first ones of the full
            evaluation's).
        with_texts: Keep each task's text in its row (to read what a
            checkpoint writes; the experiment's summary keeps none).

    Returns:
        ``seconds`` (generation only), ``tasks`` (`evaluation_tasks`'
        rows), ``per_task`` (a row each, in order) and ``common_set``
        (``cells`` and ``trees``: each half and form's first
        `COMMON_TASKS` tasks, `compact_tree`).
    """
    llm = LLM(
        model=str(model),
        dtype="float32",
        # Prompt (about 60 tokens) and the longest completion.
        max_model_len=512,
        # Sequences (roots and children) running at once: about 25 trees.
        max_num_seqs=128,
        # Small blocks: at the CPU's default of 128 tokens a tree's
        # short children each hold a mostly empty block.
        block_size=32,
        enforce_eager=True,
        seed=0,
        **hooked_engine_args(
            dict(sync_token=task.SYNC,
                 promise_token=task.PROMISE,
                 child_role_token=task.CHILD)))
    tokenizer = llm.get_tokenizer()
    tasks = experiment.evaluation_tasks(num_tasks)
    prompts = [{
        "prompt_token_ids":
        tokenizer.apply_chat_template(task.messages_of(
            task.Task(tuple(t["countries"]), t["form"] == "parallel")),
                                      add_generation_prompt=True,
                                      return_dict=False)
    } for t in tasks]
    greedy = SamplingParams(temperature=0.0,
                            max_tokens=experiment.EVAL_MAX_TOKENS)
    start = time.monotonic()
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    seconds = time.monotonic() - start
    marker = tokenizer.convert_tokens_to_ids(task.CHILD)
    # The common token set: each half and form's first tasks.
    common: list[tuple[str, Any]] = []
    for t, output in zip(tasks, outputs):
        cell = f"{t['half']}_{t['form']}"
        if sum(c == cell for c, _ in common) < token_scores.COMMON_TASKS:
            common.append((cell, output))
    return {
        "seconds":
        round(seconds, 1),
        "tasks":
        tasks,
        "per_task": [
            result_row(t["countries"], output, with_texts)
            for t, output in zip(tasks, outputs)
        ],
        "common_set": {
            "cells": [cell for cell, _ in common],
            "trees": [
                token_scores.compact_tree(output.prompt_token_ids,
                                          promise_tree(output),
                                          output.outputs[0].token_ids, marker)
                for _, output in common
            ],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tasks", type=int, default=experiment.EVAL_TASKS)
    parser.add_argument("--texts",
                        action="store_true",
                        help="keep each task's text in its row")
    args = parser.parse_args()
    args.out.write_text(
        json.dumps(evaluate(args.model, args.tasks, args.texts)) + "\n")


if __name__ == "__main__":
    main()
