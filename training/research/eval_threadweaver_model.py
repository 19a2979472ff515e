# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Measures models/threadweaver-toy through ThreadWeaver's controller on
stock vLLM V1 (greedy).

Held-out tasks come from ``random.Random(seed)`` (training used seed 0).
Prints the answer accuracy (the last ``answer D`` is the last digit of the
product of the groups the controller forks), the share of exact traces
(every token as a perfect model's), both per case of the task, and which
of the controller's cases the answers went through.

Usage (in .venv-v1): python training/research/eval_threadweaver_model.py
    [MODEL] [--tasks 200] [--seed 1000] [--url URL] [--max-tokens 160]
"""

import collections
import random
from pathlib import Path

from sequence_hooks_references.formats.run_threadweaver import backend_for
from sequence_hooks_references.formats.threadweaver_controller import (
    ThreadWeaverController, outline_labels, run)
from sequence_hooks_training import loop
from sequence_hooks_training import threadweaver_task as task_mod

# The model evaluated by default.
MODEL = Path(__file__).resolve().parents[2] / "models" / "threadweaver-toy"


def case_of(task) -> str:
    """The controller case a task provokes."""
    labels = [g.label for groups in task for g in groups]
    if len(labels) == 1:
        return "single group"
    if not labels[0].isdigit():
        return "letter labels"
    if any(0 in g.numbers for groups in task for g in groups):
        return "a thread ends"
    if any(len({g.label for g in groups}) < len(groups) for groups in task):
        return "repeated label"
    return "two rounds" if len(task) == 2 else "one round"


def seen_cases(rollout, eos_id: int) -> list[str]:
    """The controller's cases a rollout went through."""
    cases = []
    labels = [
        outline_labels(part) for part in rollout.text.split("</Outlines>")[:-1]
    ]
    if any(len(set(found)) < len(found) for found in labels):
        cases.append("repeated label")
    if any(not found for found in labels):
        cases.append("outlines without a label")
    if not labels:
        cases.append("no outlines")
    if any(len(fork.branches) > 1 for fork in rollout.forks):
        cases.append("several outlines")
    if any(eos_id in b.token_ids for f in rollout.forks for b in f.branches):
        cases.append("a branch hits EOS")
    if len(rollout.forks) > 1:
        cases.append("two rounds")
    return cases


def main() -> None:
    # A correct trace's longest call is under 70 tokens.
    parser = loop.toy_eval_parser(__doc__, MODEL, tasks=200, max_tokens=160)
    parser.add_argument("--url")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    tasks = [task_mod.make_task(rng) for _ in range(args.tasks)]
    tokenizer = task_mod.build_tokenizer()
    backend = backend_for(args.model, args.url)
    prompts = [
        tokenizer.encode(task_mod.prompt_of(t), add_special_tokens=False)
        for t in tasks
    ]
    rollouts = run(
        ThreadWeaverController(tokenizer, max_tokens=args.max_tokens), backend,
        prompts)
    right, exact, total = (collections.Counter() for _ in range(3))
    seen: dict[str, list[str]] = collections.defaultdict(list)
    for task, [rollout] in zip(tasks, rollouts):
        for case in seen_cases(rollout, tokenizer.eos_token_id):
            seen[case].append(task_mod.prompt_of(task))
        main_pieces, _ = task_mod.pieces(task)
        expected = "".join(p.text for p in main_pieces[1:])
        for case in (case_of(task), "all"):
            total[case] += 1
            right[case] += (task_mod.parse_answer(
                rollout.text) == task_mod.answer_of(task))
            exact[case] += rollout.text == expected
    for case in sorted(total):
        print(f"{case}: answers {right[case]}/{total[case]} "
              f"({right[case] / total[case]:.3f}), exact traces "
              f"{exact[case]}/{total[case]}")
    for case, prompts in sorted(seen.items()):
        print(f"seen: {case}: {len(prompts)}, e.g. {prompts[0]!r}")


if __name__ == "__main__":
    main()
