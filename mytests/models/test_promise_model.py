# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The embedded promise/sync model really speaks the protocol.

Held-out "expand" tasks (seeds training never used) through the hooked
engine, greedy: exact-match accuracy of at least 95 %, and every prompt
spawns one child per group (at least 2). And the parent's conclusion comes
from the merged results: when the children are made to answer otherwise,
the conclusion follows them, not the prompt."""

from sequence_hooks_training import expand_eval as evaluation

TASKS = 100
INTERVENTIONS = 40


def test_held_out_tasks_are_solved_in_parallel(expand_llm):
    report = evaluation.solve(expand_llm, TASKS, seed=1000)
    assert report["spawned_one_child_per_group"] == 1.0
    assert report["exact_match"] >= 0.95, report["failures"]


def test_the_conclusion_reads_the_merged_results(expand_llm):
    assert evaluation.follow_forced_answers(expand_llm,
                                            INTERVENTIONS,
                                            seed=2000) >= 0.95
