# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Measures models/npr-toy or models/multiverse-toy with the sequential
reference decoder (`sequence_hooks_references.layout_check`, greedy, under
the layout the model was trained with).

Held-out tasks come from ``random.Random(seed)`` (training drew from
``random.Random(0)``'s stream; a held-out prompt may repeat a training
prompt by chance, the tasks being small). Prints:

- accuracy: the answer line's letters are the words' last letters, over
  all prompts and by kind (one word; a block; for Multiverse a nested
  block);
- the fraction of answers that fork (at least one path), and whether
  each answer forks exactly when the task has several items;
- exact traces: every token as a perfect model's;
- the decoder's finishes, and `greedy_mismatches` over those of the
  first ``--check`` answers that end with EOS (0 each: the checker
  agrees with the decoder);
- with ``--interventions N``: N tasks whose paths' results are all
  replaced by other letters in a forced prefix up to the after-tag; the
  share of answers that follow the paths (the after-text reads them).

Usage: .venv/bin/python training/research/eval_parallel_layout_model.py
    [MODEL] [--format npr|multiverse] [--tasks 200] [--seed 1000]
    [--max-tokens 400] [--check 20] [--interventions 50] [--show N]
    [--write-prompts N]
"""

import collections
import json
import random
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from sequence_hooks_references.layout_check import (decode_sequential,
                                                    greedy_mismatches)
from sequence_hooks_references.parallel_layout import FORMATS
from sequence_hooks_training import loop, multiverse_task, npr_task
from sequence_hooks_training import spell_task as spell

ROOT = Path(__file__).resolve().parents[2]
TASKS = {"npr": npr_task, "multiverse": multiverse_task}
# The command line's counts: flag, default, what its N is.
COUNT_FLAGS = (
    ("--check", 20, "check greedy_mismatches on those of the first N "
     "answers that end with EOS"),
    ("--interventions", 0, "N tasks whose paths' results are all replaced: "
     "do the answers follow the paths?"),
    ("--show", 0, "print the first N wrong answers"),
    ("--write-prompts", 0, "write the first N held-out prompts to the "
     "model's prompts.jsonl (with --tasks 0: only that)"),
)


def kind_of(task_mod, task) -> str:
    """The kind of a task: one word, a block, a nested block."""
    if not task_mod.forks(task):
        return "one word"
    if task_mod is multiverse_task and multiverse_task.nests(task):
        return "nested block"
    return "block"


def format_of(model: Path) -> str:
    """The format its model card names (``format: ...``)."""
    card = model / "MODEL_CARD.md"
    for line in card.read_text().splitlines() if card.exists() else []:
        if line.startswith("format:"):
            return line.split(":", 1)[1].strip()
    raise SystemExit(f"{card} names no format: give --format")


def follows_paths(model, tokenizer, fmt, task_mod, task, rng,
                  max_tokens: int) -> bool:
    """Whether the answer follows the paths when their results are all
    replaced: the trace up to its (outermost) after-tag is forced, with
    every path's result another letter; the model writes the rest."""
    pieces = task_mod.pieces(task, rng, replaced=1.0)
    after = max(i for i, p in enumerate(pieces) if p.text == fmt.after_text())
    prefix = "".join(p.text for p in pieces[:after + 1])
    letters = spell.parse_answer("".join(p.text for p in pieces))
    ids = tokenizer.encode(prefix, add_special_tokens=False)
    out = decode_sequential(model, tokenizer, ids, fmt, max_tokens)
    text = tokenizer.decode(out.ids[len(ids):], skip_special_tokens=False)
    return spell.parse_answer(text) == letters


def write_prompts(path: Path, task_mod, tasks) -> None:
    """Writes ``tasks``' prompts, answers and kinds, one JSON a line."""
    with open(path, "w") as f:
        for task in tasks:
            f.write(
                json.dumps({
                    "prompt": task_mod.prompt_of(task),
                    "answer": " ".join(task_mod.answer_of(task)),
                    "kind": kind_of(task_mod, task)
                }) + "\n")


def main() -> None:
    parser = loop.toy_eval_parser(__doc__, None, tasks=200, max_tokens=400)
    parser.add_argument("--format", choices=sorted(TASKS))
    for flag, default, meaning in COUNT_FLAGS:
        parser.add_argument(flag, type=int, default=default, help=meaning)
    args = parser.parse_args()
    if args.model is None and args.format is None:
        parser.error("give MODEL or --format")
    name = args.format or format_of(Path(args.model))
    model_dir = Path(args.model or ROOT / "models" / f"{name}-toy")
    fmt, task_mod = FORMATS[name], TASKS[name]
    torch.manual_seed(0)
    tokenizer = task_mod.build_tokenizer()
    model = LlamaForCausalLM.from_pretrained(model_dir,
                                             attn_implementation="sdpa")
    model.eval()
    rng = random.Random(args.seed)
    tasks = [
        task_mod.make_task(rng)
        for _ in range(max(args.tasks, args.write_prompts))
    ]
    if args.write_prompts:
        write_prompts(model_dir / "prompts.jsonl", task_mod,
                      tasks[:args.write_prompts])
    tasks = tasks[:args.tasks]
    if not tasks:
        return
    right, exact, total = (collections.Counter() for _ in range(3))
    forked = fork_as_task = nested = 0
    finishes: collections.Counter = collections.Counter()
    mismatched = checked = 0
    tags = fmt.tags(tokenizer)
    for n, task in enumerate(tasks):
        prompt = tokenizer.encode(task_mod.prompt_of(task),
                                  add_special_tokens=False)
        out = decode_sequential(model, tokenizer, prompt, fmt, args.max_tokens)
        text = tokenizer.decode(out.ids[len(prompt):],
                                skip_special_tokens=False)
        finishes[out.finish.split(":")[0]] += 1
        forked += bool(out.paths)
        fork_as_task += bool(out.paths) == task_mod.forks(task)
        nested += any(p.depth > 0 for p in out.paths)
        correct = spell.parse_answer(text) == task_mod.answer_of(task)
        if not correct and args.show > 0:
            args.show -= 1
            print(f"wrong ({out.finish}): {task_mod.prompt_of(task)!r}\n"
                  f"{text}")
        for kind in (kind_of(task_mod, task), "all"):
            total[kind] += 1
            right[kind] += correct
            exact[kind] += text == task_mod.expected_text(task)
        if n < args.check and out.finish == "eos":
            checked += 1
            mismatched += bool(
                greedy_mismatches(model, out.ids, len(prompt), tags,
                                  out.forced))
    for kind in sorted(total):
        print(f"{kind}: accuracy {right[kind]}/{total[kind]} "
              f"({right[kind] / total[kind]:.3f}), exact traces "
              f"{exact[kind]}/{total[kind]}")
    print(f"answers that fork: {forked}/{len(tasks)} "
          f"({forked / len(tasks):.3f}); fork exactly when the task has "
          f"several items: {fork_as_task}/{len(tasks)}")
    if task_mod is multiverse_task:
        print(f"answers with a nested block: {nested}/{len(tasks)} (tasks "
              f"with a pair: "
              f"{sum(map(multiverse_task.nests, tasks))}/{len(tasks)})")
    print(f"finishes: {dict(finishes)}")
    print(f"greedy_mismatches: {mismatched} of {checked} answers checked "
          f"have any")
    if args.interventions:
        irng = random.Random(args.seed + 1)
        chosen = []
        while len(chosen) < args.interventions:
            task = task_mod.make_task(irng)
            if task_mod.forks(task):
                chosen.append(task)
        follow = sum(
            follows_paths(model, tokenizer, fmt, task_mod, t, irng,
                          args.max_tokens) for t in chosen)
        print(f"interventions: the answer follows the replaced results in "
              f"{follow}/{len(chosen)}")


if __name__ == "__main__":
    main()
