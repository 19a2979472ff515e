# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The experiment over seeds (`rl/experiment/rl_seeds.py`, issue 46's
addendum): P1 to P4 judged on the seeds' mean with the country-level test
paired across seeds, B's collapse judged per seed, the common-set scores
and the summary file that holds the seeds and the first run apart."""

import json

import pytest
import rl_experiment as experiment
import rl_seeds

# Six countries a half, a task each (the signed-rank test needs six
# countries all one way to reach 2/64 < 0.05).
COUNTRIES = {
    half: [f"{half[0].upper()}{i}" for i in range(6)]
    for half in experiment.HALVES
}
TASKS = [{
    "half": half,
    "form": form,
    "countries": [country]
} for half in experiment.HALVES for form in experiment.FORMS
         for country in COUNTRIES[half]]


def part(right: int = 1,
         path: int = 50,
         cut: bool = False,
         **cells: list[int]) -> dict:
    """An evaluated part: per task one country, right or not (``cells``
    override a cell's six answers), with its figures."""
    rows = []
    for cell in experiment.CELLS:
        for ok in cells.get(cell, [right] * 6):
            rows.append({
                "right": [ok],
                "sentences": [ok],
                "children": 1,
                "cut": cut,
                "critical_path": path,
                "tokens": 100
            })
    return {"per_task": rows, **experiment.part_figures(TASKS, rows)}


BEFORE = part(right=0,
              path=60,
              rewarded_sequential=[1] * 6,
              heldout_sequential=[1] * 6)


def test_the_country_test_pairs_countries_across_seeds():
    ahead = part(rewarded_parallel=[1] * 6)
    behind = part(rewarded_parallel=[1, 1, 0, 0, 0, 0])
    differences = rl_seeds.country_differences(TASKS, {
        "0": ahead,
        "1": ahead
    }, "rewarded_parallel", {
        "0": behind,
        "1": ahead
    }, "rewarded_parallel", ("0", "1"))
    # Averaged over the two seeds: ahead in one, tied in the other.
    assert differences == {
        "R0": 0.0,
        "R1": 0.0,
        "R2": 0.5,
        "R3": 0.5,
        "R4": 0.5,
        "R5": 0.5
    }
    test = rl_seeds.country_test(differences)
    assert test["ahead"] == "first"
    # Four ties of rank 2.5, all positive: 2 of 16 sign assignments.
    assert test["signed_rank_p"] == 2 / 16
    assert (test["up"], test["down"]) == (4, 0)
    assert rl_seeds.country_test({
        c: -d
        for c, d in differences.items()
    })["ahead"] == "second"


def test_p1_to_p4_are_judged_on_the_mean_once_every_seed_is_in():
    a = part(path=40)
    b = part(right=0, path=60)
    c = part(path=100)
    arms = {
        "A": dict.fromkeys(rl_seeds.SEEDS, a),
        "B": dict.fromkeys(rl_seeds.SEEDS, b),
        "C": dict.fromkeys(rl_seeds.SEEDS, c),
    }
    result = rl_seeds.criteria(TASKS, BEFORE, arms)
    p1 = result["P1"]
    assert p1["value"] == 1.0 and p1["complete"] and p1["met"]
    assert p1["test"]["signed_rank_p"] == 2 / 64
    assert p1["seeds"]["1"] == {"value": 1.0, "threshold": 0.05, "met": True}
    assert result["P2"]["met"]
    assert result["P2"]["value"]["cut"] == 0
    assert result["P3"]["value"]["over_c"] == 0.4
    assert result["P3"]["met"]
    assert result["P4"]["value"] == 0.0 and result["P4"]["met"]
    # Two seeds of three: each seed judged, the mean not yet.
    partial = rl_seeds.criteria(
        TASKS, BEFORE, {
            arm: {
                s: p
                for s, p in parts.items() if s != "2"
            }
            for arm, parts in arms.items()
        })
    assert all(partial[p]["met"] is None and not partial[p]["complete"]
               for p in ("P1", "P2", "P3", "P4"))
    assert partial["P1"]["seeds"]["0"]["met"]
    # A gain of 1/3 in the mean but from two countries only: the test
    # (2 of 4 sign assignments) misses, so P1 does.
    narrow = part(path=40, rewarded_parallel=[1, 1, 0, 0, 0, 0])
    result = rl_seeds.criteria(
        TASKS, BEFORE, {
            **arms, "A": dict.fromkeys(rl_seeds.SEEDS, narrow)
        })
    assert result["P1"]["value"] == pytest.approx(1 / 3)
    assert result["P1"]["test"]["signed_rank_p"] == 0.5
    assert not result["P1"]["met"]
    # C ahead on four countries: the gap misses P4; the test leans to C.
    assert not result["P4"]["met"]
    assert result["P4"]["test"]["ahead"] == "second"
    # Cut texts: the starting model's none, so one is a rise.
    cut = rl_seeds.criteria(TASKS, BEFORE, {
        **arms, "A": {
            **arms["A"], "2": part(path=40, cut=True)
        }
    })
    assert cut["P2"]["value"]["cut"] == 24
    assert cut["P2"]["threshold"]["cut"] == 0
    assert not cut["P2"]["met"]


def test_bs_collapse_is_judged_per_seed_on_both_sequential_cells():
    fell = part(rewarded_sequential=[0] * 6, heldout_sequential=[0] * 6)
    kept = part()
    one_half = part(rewarded_sequential=[0] * 6)

    def verdict(seed1: dict, seed2: dict) -> str:
        return rl_seeds.sequential_falls(
            TASKS, BEFORE, {"B": {
                "0": fell,
                "1": seed1,
                "2": seed2
            }})["B_collapse"]

    falls = rl_seeds.sequential_falls(TASKS, BEFORE, {"B": {"0": fell}})
    rewarded = falls["B"]["0"]["rewarded"]
    assert rewarded["accuracy"] == 0 and rewarded["below"] == 0.5
    assert rewarded["test"]["signed_rank_p"] == 2 / 64 and rewarded["fell"]
    # Not every seed yet: no verdict.
    assert falls["B_collapse"] is None
    assert verdict(fell, fell) == "replicates"
    assert verdict(fell, kept) == "fails"
    assert verdict(one_half, fell) == "partial"


def test_the_summary_keeps_seeds_and_the_first_run_apart():
    before = {"commit": "new", **BEFORE}
    before["common_set_scores"] = {"entropy": 0.3, "kl": 0.0}
    first = {
        "tasks": TASKS,
        "before": {
            "commit": "old",
            "per_task": BEFORE["per_task"][:-1] + [part()["per_task"][-1]]
        },
        "arms": {
            "A": {
                "commit": "old",
                "per_task": part()["per_task"]
            }
        },
    }

    def scored(entropy: float, kl: float) -> dict:
        return {
            "per_task": part()["per_task"],
            "log": [{
                "step": 1,
                "kl": kl
            }],
            "common_set_scores": {
                "entropy": entropy,
                "kl": kl
            },
        }

    results = {
        "tasks": TASKS,
        "before": before,
        "arms": {
            "A": {
                "seeds": {
                    "0": scored(0.2, 0.01),
                    "1": scored(0.4, 0.03),
                    # Trained, not evaluated yet.
                    "2": {
                        "steps": 36,
                        "log": []
                    },
                }
            }
        },
        "seed0_854d345": first,
    }
    summary = rl_seeds.summarize(results)
    seeds = summary["arms"]["A"]["seeds"]
    assert seeds["1"]["rewarded_parallel"]["accuracy"] == 1.0
    assert seeds["1"]["kl"] == 0.03
    assert "rewarded_parallel" not in seeds["2"]
    assert summary["common_set"]["A"]["mean"] == {
        "entropy": pytest.approx(0.3),
        "kl": pytest.approx(0.02)
    }
    assert summary["common_set"]["before"]["entropy"] == 0.3
    assert summary["criteria"]["P2"]["seeds"]["1"]["met"] is True
    assert not summary["criteria"]["P2"]["complete"]
    assert set(summary["comparisons"]) == {"0", "1"}
    # The first run: its own summary, one starting-model row differing.
    old = summary["seed0_854d345"]
    assert old["before_rows_differing"] == 1
    assert old["arms"]["A"]["commit"] == "old"
    assert summary["commit"] == "new"
    # Summarizing the summary changes nothing; its file reads back as it.
    assert rl_seeds.summarize(summary) == summary
    assert json.loads(experiment.dumps(summary)) == summary


def test_runs_are_recorded_by_seed_into_the_summary_file(tmp_path):
    import rl_capitals
    results, plot = tmp_path / "rl_arms.json", tmp_path / "rl_arms.png"
    # A summary file with the first run only (no starting model yet).
    results.write_text(
        experiment.dumps(
            rl_seeds.summarize({
                "tasks": TASKS,
                "seed0_854d345": {
                    "tasks": TASKS
                }
            })) + "\n")
    rl_capitals.record(results, plot, "before", 0, {
        "tasks": TASKS,
        "per_task": BEFORE["per_task"]
    })
    for seed in (1, 2):
        rl_capitals.record(results, plot, "B", seed, {
            "tasks": TASKS,
            "per_task": part(right=0)["per_task"]
        })
    summary = json.loads(results.read_text())
    assert summary["before"]["rewarded_sequential"]["accuracy"] == 1.0
    assert set(summary["arms"]["B"]["seeds"]) == {"1", "2"}
    assert summary["arms"]["B"]["seeds"]["2"]["code_dirty"] in (True, False)
    assert summary["sequential_falls"]["B"]["1"]["heldout"]["fell"]
    assert plot.stat().st_size > 0
    with pytest.raises(ValueError, match="other evaluation tasks"):
        rl_capitals.record(results, plot, "C", 0, {
            "tasks": TASKS[:4],
            "per_task": []
        })
