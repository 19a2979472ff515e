# SPDX-License-Identifier: Apache-2.0
"""The embedded promise/sync model really speaks the protocol.

Held-out "expand" tasks (seeds training never used) through the hooked
engine, greedy: exact-match accuracy of at least 95 %, and every prompt
spawns one child per group (at least 2). And the parent's conclusion comes
from the merged results: when the children are made to answer otherwise,
the conclusion follows them, not the prompt."""

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "expand"
sys.path.insert(0, str(ROOT / "tools"))
evaluation = importlib.import_module("eval_promise_model")

TASKS = 100
INTERVENTIONS = 40


@pytest.fixture(scope="module")
def expand_llm():
    return evaluation.load(str(MODEL))


def test_held_out_tasks_are_solved_in_parallel(expand_llm):
    report = evaluation.solve(expand_llm, TASKS, seed=1000)
    assert report["spawned_one_child_per_group"] == 1.0
    assert report["exact_match"] >= 0.95, report["failures"]


def test_the_conclusion_reads_the_merged_results(expand_llm):
    assert evaluation.follow_forced_answers(expand_llm,
                                            INTERVENTIONS,
                                            seed=2000) >= 0.95
