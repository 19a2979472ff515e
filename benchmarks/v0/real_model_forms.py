# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The real model, parallel form vs sequential form, on the same prompts.

SmolLM2-135M-Instruct fine-tuned to speak promise/sync
(models/smollm2-promise) answers held-out capitals tasks of k countries
through one hooked V0 engine (fp32, eager, the CPU's default KV block size,
128). The system prompt selects the form: parallel (one child per country,
sync, conclusion) or sequential (the same sentences in turn). Side by side
in one run, alternating forms task by task:

- latency: one request in flight; per task the wall time, engine steps,
  tokens the model sampled (parent and children) and its accuracy;
- batch: all tasks of a size at once, wall time (mean of two runs per
  form, in the order ABBA) and steps.

Reports per k the means, the parallel/sequential ratios and accuracy per
country: of the conclusion (its capital exactly right) and of the item
sentences (the sentence about the country names its capital exactly).
Prints a table, writes JSON.

Usage: PYTHONPATH=training/research .venv/bin/python
    benchmarks/v0/real_model_forms.py
    [--ks 2 4 8] [--tasks 6] [--out real_model_forms.json]
"""

import argparse
import random
import statistics
import time

import eval_real_model as evaluation

from sequence_hooks_bench.runs import count_steps, report
from sequence_hooks_training import capitals_task as task
from sequence_hooks_training import prepare_base_model as prepare


def sampled_tokens(output) -> int:
    """Tokens the model sampled for ``output``: the parent's own (merged
    tokens excluded) and every descendant's."""
    tree = output.promise_tree
    if tree is None:
        return len(output.outputs[0].token_ids)

    def own(node) -> int:
        return (len(node.token_ids) - node.num_merged_tokens +
                sum(own(child) for child in node.children))

    return own(tree)


def timed(llm, counter, tasks: list[task.Task]):
    """Generates ``tasks`` in one batch, greedy.

    Returns:
        The outputs, the wall time in seconds and the engine steps.
    """
    from vllm import SamplingParams
    prompts = [evaluation.chat_prompt(llm, task.messages_of(t)) for t in tasks]
    counter[0] = 0
    start = time.perf_counter()
    outputs = llm.generate(prompts,
                           SamplingParams(temperature=0.0,
                                          max_tokens=evaluation.MAX_TOKENS),
                           use_tqdm=False)
    return outputs, time.perf_counter() - start, counter[0]


def measure(llm, counter, k: int, num_tasks: int, seed: int) -> dict:
    """Both forms on ``num_tasks`` held-out tasks of ``k`` countries.

    Returns:
        The row of the report for ``k``.
    """
    parallel = [
        task.make_task(random.Random(seed + i), task.HELD_OUT_COUNTRIES, True,
                       k) for i in range(num_tasks)
    ]
    forms = {
        "parallel": parallel,
        "sequential": [task.Task(t.countries, False) for t in parallel]
    }
    single = {form: [] for form in forms}
    for i in range(num_tasks):
        # Alternate which form goes first, so drift hits both alike.
        order = list(forms) if i % 2 == 0 else list(forms)[::-1]
        for form in order:
            [out], wall, steps = timed(llm, counter, [forms[form][i]])
            text = out.outputs[0].text
            right = task.answers_correct(forms[form][i], text)
            said = task.sentences_correct(forms[form][i], text)
            children = (len(out.promise_tree.children)
                        if out.promise_tree else 0)
            single[form].append(
                (wall, steps, sampled_tokens(out), right, children == k, said))
    batch = {form: [] for form in forms}
    # Each form's batch twice, in the order ABBA: drift hits both alike.
    for form in list(forms) + list(forms)[::-1]:
        _, wall, steps = timed(llm, counter, forms[form])
        batch[form].append((wall, steps))
    row = {"k": k, "tasks": num_tasks}
    for form, runs in single.items():
        row[f"{form}_s"] = round(statistics.mean(r[0] for r in runs), 2)
        row[f"{form}_steps"] = round(statistics.mean(r[1] for r in runs), 1)
        row[f"{form}_tokens"] = round(statistics.mean(r[2] for r in runs), 1)
        row[f"{form}_accuracy"] = round(
            sum(sum(r[3]) for r in runs) / (k * num_tasks), 2)
        row[f"{form}_sentence_accuracy"] = round(
            sum(sum(r[5]) for r in runs) / (k * num_tasks), 2)
        row[f"{form}_batch_s"] = round(
            statistics.mean(wall for wall, _ in batch[form]), 2)
        row[f"{form}_batch_steps"] = batch[form][0][1]
    row["one_child_per_country"] = round(
        sum(r[4] for r in single["parallel"]) / num_tasks, 2)
    row["latency_ratio"] = round(row["sequential_s"] / row["parallel_s"], 2)
    row["batch_ratio"] = round(
        row["sequential_batch_s"] / row["parallel_batch_s"], 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tasks", type=int, default=6)
    parser.add_argument("--seed", type=int, default=5000)
    parser.add_argument("--model",
                        help="the fine-tuned checkpoint (default: set-up's)")
    parser.add_argument("--out", default="real_model_forms.json")
    args = parser.parse_args()
    model = args.model or prepare.merge_delta()
    llm = evaluation.load(model)
    counter = count_steps(llm)
    # Warm-up: both forms once.
    timed(llm, counter, [
        task.Task(("France", "Peru"), True),
        task.Task(("France", "Peru"), False)
    ])
    rows = [
        measure(llm, counter, k, args.tasks, args.seed + 100 * k)
        for k in args.ks
    ]
    print("\nfp32, KV block size 128 (CPU default), greedy, eager; "
          "latency: 1 request in flight; batch: all tasks of a k at once")
    report(rows, args.out, [
        "k", "parallel_s", "sequential_s", "latency_ratio", "parallel_steps",
        "sequential_steps", "parallel_tokens", "sequential_tokens",
        "parallel_batch_s", "sequential_batch_s", "batch_ratio",
        "parallel_accuracy", "sequential_accuracy",
        "parallel_sentence_accuracy", "sequential_sentence_accuracy",
        "one_child_per_country"
    ])


if __name__ == "__main__":
    main()
