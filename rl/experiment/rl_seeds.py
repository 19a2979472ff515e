# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The experiment over seeds (docs/rl.md, the addendum of issue 46): P1
to P4 judged across the seeds, B's collapse judged per seed, and the
common-set entropy and KL per arm and seed.

Pure Python over `rl_experiment`'s figures: each arm's evaluated seeds
(``{arm: {seed: part}}``, a part holding its ``per_task`` rows and
`rl_experiment.part_figures`) and the starting model's one evaluation.
"""

import statistics
from pathlib import Path
from typing import Any, Optional

import rl_experiment as experiment

# The pre-registered seeds: a criterion across seeds is judged only once
# every arm it compares has all of them.
SEEDS = ("0", "1", "2")
# The country-level tests' level (two-sided).
ALPHA = 0.05
# P2: A's cut texts over the four cells and the seeds, at most this many
# times the starting model's over the four cells (one each seed: no rise).
P2_MAX_CUT_OVER_BEFORE = len(SEEDS)
# B's collapse: a sequential cell falls when its accuracy is below this
# share of the starting model's and its countries fell significantly.
COLLAPSE_SHARE = 0.5
# The seeds in which no sequential cell falling means the collapse did
# not replicate (seed 0 was the first run's).
NEW_SEEDS = ("1", "2")


def country_differences(tasks: list[dict], one: dict[str, dict], cell_one: str,
                        other: dict[str, dict], cell_other: str,
                        seeds: tuple[str, ...]) -> dict[str, float]:
    """Per country, its accuracy in one arm's cell minus the other's,
    averaged over ``seeds`` (countries as the unit, paired across seeds).

    Args:
        tasks: `rl_experiment.evaluation_tasks`' rows.
        one: Seed -> part of the first arm (or the starting model's one
            part under every seed).
        cell_one: Its cell (for example ``rewarded_parallel``).
        other: Seed -> part of the second.
        cell_other: Its cell (the same half: the same countries, in the
            same tasks).
        seeds: The seeds averaged over.

    Returns:
        Country -> the mean difference.
    """

    def accuracy(part: dict, cell: str) -> dict[str, float]:
        index = [
            i for i, t in enumerate(tasks)
            if f"{t['half']}_{t['form']}" == cell
        ]
        return experiment.country_accuracy(
            [tasks[i] for i in index], [part["per_task"][i] for i in index])

    per_seed = [(accuracy(one[s], cell_one), accuracy(other[s], cell_other))
                for s in seeds]
    countries = sorted(per_seed[0][0])
    return {
        c: statistics.fmean(a[c] - b[c] for a, b in per_seed)
        for c in countries
    }


def country_test(differences: dict[str, float]) -> dict:
    """The pre-registered test over paired country differences.

    Args:
        differences: Country -> mean difference (`country_differences`).

    Returns:
        ``differences``; ``ahead`` ("first", "second" or None: which arm
        the positive and negative rank sums favour); ``signed_rank_p``
        (the exact two-sided Wilcoxon test, the verdict's); and beside it
        ``up``, ``down`` and ``sign_test_p`` (reported, not judged).
    """
    values = list(differences.values())
    nonzero = sorted((abs(d), d) for d in values if d != 0)
    # Mean ranks of tied absolute values (as the test ranks them).
    ranks: dict[float, float] = {}
    start = 0
    while start < len(nonzero):
        end = start
        while end < len(nonzero) and nonzero[end][0] == nonzero[start][0]:
            end += 1
        ranks[nonzero[start][0]] = (start + 1 + end) / 2
        start = end
    plus = sum(ranks[abs(d)] for _, d in nonzero if d > 0)
    minus = sum(ranks[abs(d)] for _, d in nonzero if d < 0)
    up, down = sum(d > 0 for d in values), sum(d < 0 for d in values)
    return {
        "differences": differences,
        "ahead":
        ("first" if plus > minus else "second" if minus > plus else None),
        "signed_rank_p": experiment.signed_rank_test_p(values),
        "up": up,
        "down": down,
        "sign_test_p": experiment.sign_test_p(up, down),
    }


def _mean(values: list[float]) -> Optional[float]:
    return statistics.fmean(values) if values else None


def _judged(per_seed: dict[str, Optional[dict]],
            complete: bool,
            value: Any,
            threshold: Any,
            met: bool,
            test: Optional[dict] = None) -> dict:
    """A criterion across seeds: every seed's own, the mean's verdict
    (None until every pre-registered seed is in)."""
    return {
        "seeds": per_seed,
        "value": value,
        "threshold": threshold,
        **({
            "test": test
        } if test is not None else {}),
        "complete": complete,
        "met": met if complete else None,
    }


def criteria(tasks: list[dict], before: dict,
             arms: dict[str, dict[str, dict]]) -> dict:
    """P1 to P4 per seed and across the seeds, as pre-registered.

    Args:
        tasks: `rl_experiment.evaluation_tasks`' rows.
        before: The starting model's part (figures and ``per_task``).
        arms: Arm -> seed -> its evaluated part.

    Returns:
        ``P1`` to ``P4``, each with ``seeds`` (seed ->
        `rl_experiment.criteria`'s entry, None where an arm is missing),
        ``value`` and ``threshold`` over the seeds' mean, ``test`` where
        the addendum names one, ``complete`` and ``met``.
    """
    a, b, c = (arms.get(arm, {}) for arm in experiment.ARMS)
    seeds = sorted({s for parts in arms.values() for s in parts})
    per_seed = {
        s:
        experiment.criteria(before, {
            arm: parts[s]
            for arm, parts in arms.items() if s in parts
        })
        for s in seeds
    }

    def seeds_of(name: str) -> dict[str, Optional[dict]]:
        return {s: per_seed[s][name] for s in seeds}

    def has(*parts: dict) -> tuple[str, ...]:
        return tuple(s for s in SEEDS if all(s in p for p in parts))

    def change(part: dict, cell: str) -> float:
        return part[cell]["accuracy"] - before[cell]["accuracy"]

    result: dict[str, dict] = {}
    both = has(a, b)
    gap = _mean([
        change(a[s], "rewarded_parallel") - change(b[s], "rewarded_parallel")
        for s in both
    ])
    test = (country_test(
        country_differences(tasks, a, "rewarded_parallel", b,
                            "rewarded_parallel", both)) if both else None)
    result["P1"] = _judged(
        seeds_of("P1"),
        len(both) == len(SEEDS), gap, experiment.P1_MIN_GAIN_OVER_B,
        gap is not None and gap >= experiment.P1_MIN_GAIN_OVER_B
        and test is not None and test["ahead"] == "first"
        and test["signed_rank_p"] < ALPHA, test)

    done = has(a)
    value: dict[str, Any] = {
        f"heldout_{form}_change":
        _mean([change(a[s], f"heldout_{form}") for s in done])
        for form in experiment.FORMS
    }
    threshold: dict[str, Any] = {
        key: -experiment.P2_MAX_HELDOUT_DROP
        for key in value
    }
    for half in experiment.HALVES:
        key = f"one_child_per_country_{half}"
        value[key] = _mean(
            [a[s][f"{half}_parallel"]["one_child_per_country"] for s in done])
        threshold[key] = min(
            experiment.P2_MIN_ONE_CHILD_PER_COUNTRY,
            before[f"{half}_parallel"]["one_child_per_country"] -
            experiment.P2_MAX_ONE_CHILD_DROP)
    value["cut"] = sum(a[s][cell]["cut"] for s in done
                       for cell in experiment.CELLS)
    threshold["cut"] = P2_MAX_CUT_OVER_BEFORE * sum(
        before[cell]["cut"] for cell in experiment.CELLS)
    result["P2"] = _judged(
        seeds_of("P2"),
        len(done) == len(SEEDS), value, threshold,
        bool(done) and value["cut"] <= threshold["cut"]
        and all(value[k] >= threshold[k] for k in threshold if k != "cut"))

    both = has(a, c)
    path = _mean([a[s]["median_critical_path"]["parallel"] for s in both])
    c_path = _mean([c[s]["median_critical_path"]["sequential"] for s in both])
    value = {
        "median_critical_path":
        path,
        "over_before":
        path / before["median_critical_path"]["parallel"] if both else None,
        "over_c":
        path / c_path if both else None,
    }
    threshold = {
        "over_before": 1.0,
        "over_c": experiment.P3_MAX_PATH_RATIO_TO_C
    }
    result["P3"] = _judged(
        seeds_of("P3"),
        len(both) == len(SEEDS), value, threshold,
        bool(both) and value["over_before"] <= 1.0
        and value["over_c"] <= experiment.P3_MAX_PATH_RATIO_TO_C)

    gap = _mean([
        a[s]["rewarded_parallel"]["accuracy"] -
        c[s]["rewarded_sequential"]["accuracy"] for s in both
    ])
    test = (country_test(
        country_differences(tasks, a, "rewarded_parallel", c,
                            "rewarded_sequential", both)) if both else None)
    result["P4"] = _judged(
        seeds_of("P4"),
        len(both) == len(SEEDS), gap, -experiment.P4_MAX_DEFICIT_TO_C,
        gap is not None and gap >= -experiment.P4_MAX_DEFICIT_TO_C
        and test is not None
        and not (test["ahead"] == "second" and test["signed_rank_p"] < ALPHA),
        test)
    return result


def sequential_falls(tasks: list[dict], before: dict,
                     arms: dict[str, dict[str, dict]]) -> dict:
    """Whether each arm's sequential form fell, per seed and half, and
    the verdict on B's collapse.

    A cell falls when its accuracy is below `COLLAPSE_SHARE` of the
    starting model's and the signed-rank test over its countries (the
    arm's accuracy minus the starting model's) gives p < `ALPHA` with
    the arm lower.

    Args:
        tasks: `rl_experiment.evaluation_tasks`' rows.
        before: The starting model's part.
        arms: Arm -> seed -> its evaluated part.

    Returns:
        Arm -> seed -> half -> ``accuracy``, ``below``, ``test`` and
        ``fell``; and ``B_collapse``: "replicates" if both halves fell in
        every pre-registered seed, "fails" if in a new seed neither did,
        "partial" between, None until B has every seed.
    """
    result: dict[str, Any] = {}
    for arm, parts in sorted(arms.items()):
        result[arm] = {}
        for s, part in sorted(parts.items()):
            result[arm][s] = {}
            for half in experiment.HALVES:
                cell = f"{half}_sequential"
                below = COLLAPSE_SHARE * before[cell]["accuracy"]
                test = country_test(
                    country_differences(tasks, {s: part}, cell, {s: before},
                                        cell, (s, )))
                result[arm][s][half] = {
                    "accuracy":
                    part[cell]["accuracy"],
                    "below":
                    below,
                    "test":
                    test,
                    "fell":
                    part[cell]["accuracy"] < below
                    and test["ahead"] == "second"
                    and test["signed_rank_p"] < ALPHA,
                }
    falls = result.get("B", {})
    verdict = None
    if all(s in falls for s in SEEDS):
        fell = {
            s: [falls[s][h]["fell"] for h in experiment.HALVES]
            for s in SEEDS
        }
        verdict = ("replicates" if all(
            all(f) for f in fell.values()) else "fails" if any(
                not any(fell[s]) for s in NEW_SEEDS) else "partial")
    result["B_collapse"] = verdict
    return result


def common_set(before: dict, arms: dict[str, dict[str, dict]]) -> dict:
    """Entropy and KL to the starting model on the common token set, per
    arm: each seed's and their mean (not a criterion).

    Args:
        before: The starting model's part (its own scores: KL 0).
        arms: Arm -> seed -> part, with ``common_set_scores`` once scored.

    Returns:
        ``before`` (entropy) and per arm ``seeds`` (seed -> entropy and
        kl) and ``mean``.
    """
    result: dict[str, Any] = {
        "before": {
            key: before.get("common_set_scores", {}).get(key)
            for key in ("entropy", "kl")
        }
    }
    for arm, parts in sorted(arms.items()):
        scored = {
            s: {
                key: part["common_set_scores"][key]
                for key in ("entropy", "kl")
            }
            for s, part in sorted(parts.items()) if "common_set_scores" in part
        }
        result[arm] = {
            "seeds": scored,
            "mean": {
                key: _mean([v[key] for v in scored.values()])
                for key in ("entropy", "kl")
            },
        }
    return result


def summarize(results: dict) -> dict:
    """The summary file over seeds, every figure recomputed from the
    per-task results.

    Args:
        results: ``tasks``, ``before`` (the starting model's one
            evaluation), ``arms`` (arm -> ``seeds`` -> seed -> part with
            `rl_experiment.RAW_KEYS`), and kept as written where present:
            ``seed0_854d345`` (the first run, summarized on its own by
            `rl_experiment.summarize`, never pooled) and ``packing``.

    Returns:
        ``commit``, ``before``, ``arms`` (each seed's part with its
        figures, KL and country-level changes), ``criteria`` (`criteria`,
        across seeds), ``sequential_falls``, ``common_set``,
        ``comparisons`` (per seed), ``seed0_854d345``, ``packing`` and
        ``tasks``.
    """
    tasks = results["tasks"]
    started = ({"before": results["before"]} if results.get("before") else {})
    single = experiment.summarize({"tasks": tasks, **started})
    before = single["before"]
    arms: dict[str, dict] = {}
    evaluated: dict[str, dict[str, dict]] = {}
    for name, raw in sorted(results.get("arms", {}).items()):
        seeds = {}
        for seed, part in sorted(raw["seeds"].items()):
            one = experiment.summarize({
                "tasks": tasks,
                "arms": {
                    name: part
                },
                **started
            })
            seeds[seed] = one["arms"][name]
            if "per_task" in part:
                evaluated.setdefault(name, {})[seed] = seeds[seed]
        arms[name] = {"seeds": seeds}
    judged = before is not None and bool(evaluated)
    every_seed = sorted({s for parts in evaluated.values() for s in parts})
    return {
        "commit":
        single["commit"],
        "before":
        before,
        "arms":
        arms,
        "criteria":
        criteria(tasks, before, evaluated) if judged else None,
        "sequential_falls":
        sequential_falls(tasks, before, evaluated) if judged else None,
        "common_set":
        common_set(before, evaluated) if judged else None,
        "comparisons": {
            s:
            experiment.comparisons(tasks, {
                arm: parts[s]
                for arm, parts in evaluated.items() if s in parts
            })
            for s in every_seed
        },
        **({
            "seed0_854d345": first_run(results["seed0_854d345"], before)
        } if "seed0_854d345" in results else {}),
        **({
            "packing": results["packing"]
        } if "packing" in results else {}),
        "tasks":
        tasks,
    }


def first_run(results: dict, before: Optional[dict]) -> dict:
    """The first run (854d345, per-node rows, one seed), summarized on
    its own, and how many of its starting model's per-task rows the new
    evaluation of the same model does not repeat.

    Args:
        results: The first run's ``tasks``, ``before`` and ``arms``.
        before: The starting model's new evaluation (None if not yet).

    Returns:
        `rl_experiment.summarize`'s output, with
        ``before_rows_differing`` (None without a new evaluation).
    """
    summary = experiment.summarize(results)
    summary["before_rows_differing"] = (
        None if not (before and summary["before"]) else sum(
            old != new for old, new in zip(results["before"]["per_task"],
                                           before["per_task"])))
    return summary


def plot(summary: dict, path: Path) -> None:
    """Draws each arm's reward curve per seed and the accuracies: the
    starting model's, and each arm's mean over its seeds with every
    seed's own as a dot.

    Args:
        summary: `summarize`'s output.
        path: The picture to write.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(11, 3.8))
    # One colour an arm in both panels; one line style a seed.
    colour = {"before": "grey", "A": "C0", "B": "C1", "C": "C2"}
    style = {"0": "-", "1": "--", "2": ":"}
    window = 5
    for name, arm in summary["arms"].items():
        for seed, part in arm["seeds"].items():
            log = [e for e in part.get("log", []) if "reward" in e]
            rewards = [e["reward"] for e in log]
            running = [
                statistics.fmean(rewards[max(0, i - window + 1):i + 1])
                for i in range(len(rewards))
            ]
            curves.plot([e["step"] for e in log],
                        running,
                        color=colour[name],
                        linestyle=style.get(seed, "-."),
                        label=f"{name} seed {seed}")
    curves.set_xlabel("GRPO step")
    curves.set_ylabel(f"reward (running mean of {window})")
    curves.set_title("Training reward per arm and seed")
    curves.legend(loc="lower right", fontsize=6, ncol=3)
    parts = ([("before", {
        "-": summary["before"]
    })] if summary["before"] else [])
    parts += [(name, {
        s: p
        for s, p in arm["seeds"].items() if "per_task" in p
    }) for name, arm in summary["arms"].items()]
    parts = [(name, seeds) for name, seeds in parts if seeds]
    cells = experiment.CELLS
    width = 0.8 / max(len(parts), 1)
    for i, (name, seeds) in enumerate(parts):
        xs = [c + i * width for c in range(len(cells))]
        means = [
            statistics.fmean(p[cell]["accuracy"] for p in seeds.values())
            for cell in cells
        ]
        bars.bar(
            xs,
            means,
            width,
            color=colour[name],
            alpha=0.6,
            label=f"{name} ({len(seeds)} seed"
            f"{'s' if len(seeds) > 1 else ''})" if name != "before" else name)
        for p in seeds.values():
            bars.plot(xs, [p[cell]["accuracy"] for cell in cells],
                      "o",
                      color=colour[name],
                      markersize=3)
    bars.set_xticks([c + 0.4 - width / 2 for c in range(len(cells))])
    bars.set_xticklabels([cell.replace("_", "\n") for cell in cells],
                         fontsize=8)
    bars.set_ylabel("capitals right (conclusion, per country)")
    bars.set_ylim(0, 1)
    bars.set_title("Greedy evaluation: mean over seeds, each seed a dot")
    bars.legend(fontsize=7)
    fig.suptitle("GRPO on promise trees, SmolLM2-135M promise model: "
                 "three arms over seeds (docs/rl.md)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
