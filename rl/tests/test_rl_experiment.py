# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The three-arm experiment's pure parts
(`rl/experiment/rl_experiment.py`): the data split, the gated reward,
the sign test, the figures and criteria computed from per-task results,
and the summary that recomputes them."""

import json

import pytest
import rl_experiment as experiment

from sequence_hooks_training import capitals_task as task


def answer(countries: list[str], capitals: list[str]) -> str:
    """A sequential answer whose conclusion gives ``capitals``."""
    return (task.sequential_answer(task.Task(tuple(countries), False)) +
            task.conclusion_of(countries, capitals))


def test_the_halves_split_the_held_out_countries_and_tasks_stay_in_them():
    rewarded, heldout = experiment.split_held_out()
    assert len(rewarded) == len(heldout) == len(task.HELD_OUT_COUNTRIES) // 2
    assert sorted(rewarded + heldout) == sorted(task.HELD_OUT_COUNTRIES)
    parallel = experiment.training_tasks(20, 0, True)
    sequential = experiment.training_tasks(20, 0, False)
    # Every arm: the same countries in the same order; C's sequential.
    assert [t.countries for t in parallel] == [t.countries for t in sequential]
    assert all(t.parallel for t in parallel)
    assert not any(t.parallel for t in sequential)
    assert {c for t in parallel for c in t.countries} <= set(rewarded)
    tasks = experiment.evaluation_tasks(10)
    assert len(tasks) == 40
    for half, countries in zip(experiment.HALVES, (rewarded, heldout)):
        cell = [t for t in tasks if t["half"] == half]
        assert {c for t in cell for c in t["countries"]} <= set(countries)
        parallel_cell = [
            t["countries"] for t in cell if t["form"] == "parallel"
        ]
        assert parallel_cell == [
            t["countries"] for t in cell if t["form"] == "sequential"
        ]
        assert {len(c) for c in parallel_cell} == {3, 4, 5, 6}


def test_the_path_term_is_paid_only_when_every_capital_is_right():
    countries = ["Peru", "Chile", "France"]
    right = answer(countries, ["Lima", "Santiago", "Paris"])
    one_wrong = answer(countries, ["Lima", "Santiago", "Lyon"])
    assert experiment.capitals_share(countries, right) == 1.0
    assert experiment.capitals_share(countries,
                                     one_wrong) == pytest.approx(2 / 3)
    assert experiment.path_bonus(countries, right, 50,
                                 200) == pytest.approx(0.075)
    # Wrong, however short: nothing for the path.
    assert experiment.path_bonus(countries, one_wrong, 1, 200) == 0.0
    # At or past the limit: nothing, never negative.
    assert experiment.path_bonus(countries, right, 250, 200) == 0.0
    # The term never outweighs a capital of the largest task.
    assert experiment.BONUS_WEIGHT < 1 / experiment.MAX_ITEMS


def test_the_sign_test_is_exact_and_two_sided():
    assert experiment.sign_test_p(0, 5) == pytest.approx(2 / 32)
    assert experiment.sign_test_p(9, 1) == pytest.approx(2 * 11 / 1024)
    assert experiment.sign_test_p(1, 9) == experiment.sign_test_p(9, 1)
    assert experiment.sign_test_p(3, 3) == 1.0
    assert experiment.sign_test_p(0, 0) == 1.0


def test_the_signed_rank_test_is_exact_two_sided_and_takes_ties():
    # Six differences all one way: 2 of the 64 sign assignments are as
    # extreme (all positive, all negative).
    assert experiment.signed_rank_test_p([0.1 * k
                                          for k in range(1, 7)]) == 2 / 64
    # Zeros dropped; the test is symmetric in the sign.
    assert experiment.signed_rank_test_p(
        [0, 0.3, 0.1,
         0.2]) == experiment.signed_rank_test_p([-0.3, -0.1, -0.2])
    # Ties share their mean rank: ranks 1.5, 1.5, 3 with signs -, +, +
    # give a positive sum of 4.5 against a mean of 3; the sums as far
    # out are 4.5, 6, 1.5 and 0 (1.5 twice, 4.5 twice): 6 of 8.
    assert experiment.signed_rank_test_p([-0.1, 0.1, 0.2]) == 6 / 8
    assert experiment.signed_rank_test_p([0, 0]) == 1.0


# Two countries per half, two tasks per cell.
TASKS = [{
    "half": half,
    "form": form,
    "countries": countries
} for half in experiment.HALVES for form in experiment.FORMS
         for countries in (["X", "Y"], ["Y", "Z"])]


def row(right: list[int],
        children: int = 2,
        cut: bool = False,
        path: int = 50,
        tokens: int = 100) -> dict:
    return {
        "right": right,
        "sentences": right,
        "children": children,
        "cut": cut,
        "critical_path": path,
        "tokens": tokens
    }


def rows(per_cell: dict[str, list[dict]]) -> list[dict]:
    """Per-task rows in `TASKS`' order from each cell's two rows."""
    return [r for cell in experiment.CELLS for r in per_cell[cell]]


def uniform(right: list[int], path: int = 50, **kwargs) -> list[dict]:
    return rows({
        cell:
        [row(right, path=path, **kwargs),
         row(right, path=path, **kwargs)]
        for cell in experiment.CELLS
    })


def test_a_cells_figures_come_from_its_rows():
    tasks = TASKS[:2]
    figures = experiment.cell_figures(tasks, [
        row([1, 1], path=40, tokens=100),
        row([0, 1], children=1, cut=True, path=200, tokens=200),
    ])
    assert figures == {
        "tasks": 2,
        "accuracy": 0.75,
        "sentence_accuracy": 0.75,
        "all_right": 0.5,
        "cut": 1,
        "median_critical_path": 120,
        "mean_critical_path": 40,
        "path_over_tokens": 0.4,
        "one_child_per_country": 0.5,
    }


def test_country_changes_count_countries_not_answers():
    tasks = TASKS[:2]
    changes = experiment.country_changes(
        tasks, [row([0, 0]), row([0, 0])],
        [row([1, 1]), row([0, 0])])
    # Y is in both tasks: right in one of them after.
    assert changes["per_country"] == {"X": [0, 1], "Y": [0, 0.5], "Z": [0, 0]}
    assert (changes["up"], changes["down"], changes["same"]) == (2, 0, 1)
    assert changes["sign_test_p"] == pytest.approx(0.5)


def test_criteria_are_computed_from_the_arms_figures():
    before = experiment.part_figures(TASKS, uniform([1, 0], path=60))
    arms = {
        # A: +0.5 everywhere, a shorter path.
        "A": experiment.part_figures(TASKS, uniform([1, 1], path=45)),
        # B: no gain.
        "B": experiment.part_figures(TASKS, uniform([1, 0], path=60)),
        # C: the sequential form, a long path.
        "C": experiment.part_figures(TASKS, uniform([1, 1], path=100)),
    }
    result = experiment.criteria(before, arms)
    assert result["P1"] == {"value": 0.5, "threshold": 0.05, "met": True}
    assert result["P2"]["met"]
    assert result["P2"]["value"] == {
        "heldout_parallel_change": 0.5,
        "heldout_sequential_change": 0.5,
        "one_child_per_country_rewarded": 1.0,
        "one_child_per_country_heldout": 1.0,
        "cut_change": 0,
    }
    assert result["P2"]["threshold"]["one_child_per_country_heldout"] == 0.97
    # A starting model below 0.97 on a half: at most 0.03 lower there.
    fewer = rows({
        **{
            cell: [row([1, 0]), row([1, 0])]
            for cell in experiment.CELLS
        }, "heldout_parallel": [row([1, 0]),
                                row([1, 0], children=1)]
    })
    low_start = experiment.part_figures(TASKS, fewer)
    lower = experiment.criteria(low_start, {"A": low_start})["P2"]
    assert lower["threshold"]["one_child_per_country_heldout"] == 0.47
    assert lower["threshold"]["one_child_per_country_rewarded"] == 0.97
    assert lower["met"]
    assert result["P3"]["value"] == {
        "median_critical_path": 45,
        "over_before": 0.75,
        "over_c": 0.45
    }
    assert result["P3"]["met"]
    assert result["P4"] == {"value": 0.0, "threshold": -0.02, "met": True}
    # Between arms, countries as the unit: A's parallel answers against
    # B's (same form) and C's (its sequential form), same tasks.
    compared = experiment.comparisons(
        TASKS, {
            "A": {
                "per_task": uniform([1, 1])
            },
            "B": {
                "per_task": uniform([1, 0])
            },
            "C": {
                "per_task": uniform([1, 1])
            }
        })
    assert compared["A_over_B"]["per_country"] == {
        "X": [1, 1],
        "Y": [0.5, 1],
        "Z": [0, 1]
    }
    assert (compared["A_over_B"]["up"], compared["A_over_C"]["up"]) == (2, 0)
    # A that forgets the held-out countries and cuts a text misses P2;
    # a path longer than before misses P3; below C by more than 0.02
    # misses P4; no gain over B misses P1.
    worse = rows({
        **{
            cell: [row([1, 0]), row([1, 0])]
            for cell in experiment.CELLS
        }, "heldout_parallel": [row([0, 0]),
                                row([1, 0], cut=True)],
        "rewarded_parallel": [row([1, 0], path=70),
                              row([1, 0], path=70)]
    })
    result = experiment.criteria(
        before, {
            **arms, "A": experiment.part_figures(TASKS, worse)
        })
    assert not any(result[p]["met"] for p in ("P1", "P2", "P3", "P4"))
    assert result["P2"]["value"]["heldout_parallel_change"] == -0.25
    assert result["P2"]["value"]["cut_change"] == 1
    # Missing arms: the criteria that need them are None.
    partial = experiment.criteria(before, {"A": arms["A"]})
    assert partial["P1"] is None and partial["P3"] is None
    assert partial["P2"]["met"]


def test_the_summary_recomputes_every_figure_from_the_per_task_results():
    part = {
        "commit": "abc",
        "per_task": uniform([1, 0]),
        # Stale figures in the file are not kept.
        "rewarded_parallel": {
            "accuracy": 0.99
        },
    }
    results = {
        "tasks": TASKS,
        "before": part,
        "arms": {
            "A": {
                "steps": 3,
                "minutes": 1.0,
                "log": [{
                    "step": i,
                    "kl": 0.01 * i
                } for i in range(1, 13)],
                "per_task": uniform([1, 1]),
            },
            "B": {
                "steps": 3,
                "minutes": 1.0,
                "log": []
            },
        },
    }
    summary = experiment.summarize(results)
    assert summary["commit"] == "abc"
    assert summary["before"]["rewarded_parallel"]["accuracy"] == 0.5
    arm = summary["arms"]["A"]
    assert arm["heldout_sequential"]["accuracy"] == 1.0
    assert arm["median_critical_path"] == {"parallel": 50, "sequential": 50}
    # TRL's KL over the last 10 steps.
    assert arm["kl"] == pytest.approx(0.075)
    assert arm["countries"]["rewarded_parallel"]["per_country"]["Y"] == [
        0.5, 1.0
    ]
    # B trained but not evaluated: no figures, no criteria that need it.
    assert "rewarded_parallel" not in summary["arms"]["B"]
    assert summary["criteria"]["P1"] is None
    assert summary["comparisons"] == {}
    # Summarizing the summary changes nothing; its file reads back as it.
    assert experiment.summarize(summary) == summary
    text = experiment.dumps(summary)
    assert json.loads(text) == summary
    # A per-task row, a task, a log entry: a line each.
    lines = [line.strip() for line in text.splitlines()]
    # 8 tasks; before and A evaluated; A's 12 steps.
    assert sum(line.startswith('{"half"') for line in lines) == 8
    assert sum(line.startswith('{"right"') for line in lines) == 16
    assert sum(line.startswith('{"step"') for line in lines) == 12
