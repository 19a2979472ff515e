# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Measures models/apr-toy through APR's controller on stock vLLM V1
(greedy).

Held-out tasks come from ``random.Random(seed)`` (training used seed 0).
Prints the answer accuracy (a winning path APR's `check_solution`
verifies), how many searches called sub-searches and in how many rounds,
the children's results, the controller's errors, and what the traces'
lines show of the format and the arithmetic; and, for scale, how many of
the same tasks the training data's own search solves.

Usage (in .venv-v1): python training/research/eval_apr_model.py [MODEL]
    [--tasks 100] [--seed 1000] [--url URL] [--max-tokens 1024]
    [--show 1]
"""

import collections
import random
import re
from pathlib import Path

from sequence_hooks.formats.apr import search_result
from sequence_hooks_references.formats.apr_controller import (APRController,
                                                              run_apr)
from sequence_hooks_references.formats.run_threadweaver import backend_for
from sequence_hooks_training import apr_task, loop

# The model evaluated by default.
MODEL = Path(__file__).resolve().parents[2] / "models" / "apr-toy"
# The lines a trace is made of (search.py and the controller's joins).
LINE = re.compile("|".join([
    r"Moving to Node #\d+(,\d+)*",
    r"Current State: \d+:\[\d+(, \d+)*\], Operations: \[('[^']*'"
    r"(, '[^']*')*)?\]",
    r"Exploring Operation: \d+[-+*/]\d+=\d+, Resulting Numbers: "
    r"\[\d+(, \d+)*\]",
    r"Generated Node #\d+(,\d+)+: \d+:\[\d+(, \d+)*\] Operation: "
    r"\d+[-+*/]\d+=\d+",
    r"\d+,\d+ (un)?equal: (Goal Reached|No Solution)",
    r"No solution found\.",
    r"<(Calling |End Calling |End )?Sub Searches>",
    r"<Start Sub Search \d+ at level 1> Moving to Node #\d+(,\d+)+",
    r"<(Goal Reached|No Solution) in Sub Search \d+ at level 1 at Node "
    r"#\d+(,\d+)+>",
]))
STEP = re.compile(r"Exploring Operation: (\d+)([-+*/])(\d+)=(\d+)")


def malformed_lines(trace: str) -> int:
    """How many of the trace's lines are none of the format's."""
    return sum(not LINE.fullmatch(line) for line in trace.split("\n"))


def arithmetic(trace: str) -> tuple[int, int]:
    """(right, all) of the trace's ``Exploring Operation`` results."""
    steps = STEP.findall(trace)
    right = sum(
        apr_task.value_of(int(x), op, int(y)) == int(z)
        for x, op, y, z in steps)
    return right, len(steps)


def main() -> None:
    # A training trace's longest call writes about 800 tokens.
    parser = loop.toy_eval_parser(__doc__, MODEL, tasks=100, max_tokens=1024)
    parser.add_argument("--url")
    parser.add_argument("--show",
                        type=int,
                        default=1,
                        help="print this many searches in full")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    tasks = [apr_task.make_task(rng) for _ in range(args.tasks)]
    solved_by_data = sum(
        apr_task.random_search(t, rng).goal is not None for t in tasks)
    prompts = [apr_task.prompt_of(t) for t in tasks]
    backend = backend_for(args.model, args.url, max_model_len=2048)
    if not args.url:
        config = backend.llm.llm_engine.vllm_config
        print(f"vLLM: dtype {config.model_config.dtype}, block size "
              f"{config.cache_config.block_size}, max_model_len "
              f"{backend.max_model_len}")
    rollouts = run_apr(APRController(apr_task.BOS, args.max_tokens), backend,
                       prompts)
    count: collections.Counter = collections.Counter()
    rounds: collections.Counter = collections.Counter()
    ends: collections.Counter = collections.Counter()
    errors = []
    for prompt, out in zip(prompts, rollouts):
        count["verified"] += apr_task.check_solution(prompt, out.answer)
        count["answered"] += out.answer is not None
        count["called"] += bool(out.rounds)
        rounds[len(out.rounds)] += 1
        count["calls"] += out.calls
        children = [c for r in out.rounds for c in r]
        for r in out.rounds:
            listed = [c.split("\n", 1)[0] for c in r]
            count["calls listing a node twice"] += len(set(listed)) < len(r)
        last = out.trace.rsplit("\n", 1)[-1]
        ends[next((k for k in ("Goal Reached", "No solution found.",
                               "<End Calling Sub Searches>") if k in last),
                  "other")] += 1
        count["children"] += len(children)
        count["children solved"] += sum(
            apr_task.check_solution(c, search_result(c)) for c in children)
        count["children answered"] += sum(
            search_result(c) is not None for c in children)
        for trace in [out.trace] + children:
            bad = malformed_lines(trace)
            count["traces"] += 1
            count["well-formed traces"] += bad == 0
            right, steps = arithmetic(trace)
            count["right steps"] += right
            count["steps"] += steps
        if out.error:
            errors.append(f"{out.error} in {prompt!r}")
    n = len(tasks)
    print(f"tasks {n} (seed {args.seed}), greedy, max_tokens "
          f"{args.max_tokens}")
    print(f"answer accuracy (verified) {count['verified']}/{n} "
          f"({count['verified'] / n:.3f}); answers given "
          f"{count['answered']}/{n}; the data's own search solves "
          f"{solved_by_data}/{n}")
    print(f"searches that called sub-searches {count['called']}/{n}; "
          f"rounds {dict(sorted(rounds.items()))}; calls to vLLM "
          f"{count['calls']}")
    print(f"calls listing a node twice {count['calls listing a node twice']}"
          f"; parents' final lines: {dict(ends)}")
    print(f"children {count['children']}, answered "
          f"{count['children answered']}, verified "
          f"{count['children solved']}")
    print(f"controller errors {len(errors)}")
    for error in errors[:5]:
        print(f"  {error}")
    print(f"traces with every line well-formed {count['well-formed traces']}"
          f"/{count['traces']} (parents' final traces and children)")
    print(f"arithmetic right in {count['right steps']}/{count['steps']} "
          f"Exploring Operation lines")
    for out in rollouts[:args.show]:
        print("=== parent's final trace\n" + out.trace)
        for i, child in enumerate(c for r in out.rounds for c in r):
            print(f"=== child {i}\n{child}")
    alone = next((out for out in rollouts if not out.rounds), None)
    if alone:
        print("=== the first search that called none (40 lines)\n" +
              "\n".join(alone.trace.split("\n")[:40]))


if __name__ == "__main__":
    main()
