# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Measures the promise/sync model through the hooked engine (greedy).

Held-out tasks solved in parallel, and whether the conclusion follows
answers forced on the children (how:
`sequence_hooks_training.expand_eval`). Prints a JSON report.

Usage: .venv/bin/python training/research/eval_promise_model.py MODEL_DIR
    [--tasks 200] [--interventions 100] [--seed 1000]
"""

import argparse
import json

from sequence_hooks_training.expand_eval import (follow_forced_answers, load,
                                                 solve)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--interventions", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1000)
    args = parser.parse_args()
    llm = load(args.model)
    report = {"tasks": args.tasks, **solve(llm, args.tasks, args.seed)}
    report["interventions"] = args.interventions
    report["conclusion_follows_forced_answers"] = follow_forced_answers(
        llm, args.interventions, args.seed + 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
