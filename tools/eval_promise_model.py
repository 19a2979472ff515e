# SPDX-License-Identifier: Apache-2.0
"""Measures the promise/sync model through the hooked engine (greedy).

Held-out tasks come from a seed the training never used. A task counts as
solved when the parent's final text equals the expected one word for word
(merged children, then the number of groups) and it spawned one child per
group. Prints a JSON report.

Usage: .venv/bin/python tools/eval_promise_model.py MODEL_DIR
    [--tasks 200] [--seed 1000]
"""

import argparse
import json
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1000)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_USE_V1", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.path.insert(0, str(ROOT))
    from train_promise_model import expected_parent_text, make_task, prompt_of

    from vllm import LLM, SamplingParams
    from vllm.config import SpecialKwargs

    llm = LLM(model=args.model,
              max_model_len=256,
              enforce_eager=True,
              dtype="float32",
              special_kwargs=SpecialKwargs(sync_token="<sync>",
                                           promise_token="<promise>",
                                           child_role_token="<child>"))
    rng = random.Random(args.seed)
    tasks = [make_task(rng) for _ in range(args.tasks)]
    outputs = llm.generate([prompt_of(t) for t in tasks],
                           SamplingParams(temperature=0.0, max_tokens=128),
                           use_tqdm=False)
    solved = spawned_enough = 0
    failures = []
    for task, output in zip(tasks, outputs):
        text = output.outputs[0].text.split()
        children = (len(output.promise_tree.children)
                    if output.promise_tree else 0)
        spawned_enough += children >= 2 and children == len(task)
        if text == expected_parent_text(task).split() and children == len(
                task):
            solved += 1
        elif len(failures) < 3:
            failures.append({
                "prompt": prompt_of(task),
                "got": " ".join(text),
                "expected": expected_parent_text(task)
            })
    print(
        json.dumps(
            {
                "tasks": len(tasks),
                "exact_match": solved / len(tasks),
                "spawned_one_child_per_group": spawned_enough / len(tasks),
                "failures": failures,
            },
            indent=2))


if __name__ == "__main__":
    main()
