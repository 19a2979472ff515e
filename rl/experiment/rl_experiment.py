# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The pre-registered three-arm GRPO experiment (docs/rl.md, issue 39):
its data, its reward, and every figure and criterion of its summary,
computed from per-task results.

Pure Python (the task module only): `rl_capitals.py` trains the arms,
`rl_eval.py` produces the per-task results, this module turns them into
`models/smollm2-promise/rl_arms.json`.

- Data: the 36 countries the promise model's fine-tuning never saw,
  split by a fixed seed into the rewarded half (training draws its tasks
  from it) and the held-out half (never in training). Every arm trains on
  the same tasks in the same order; arm C gets them in the sequential
  form.
- Reward: the share of the task's countries whose capital the conclusion
  gives, plus `BONUS_WEIGHT * (1 - critical path / token limit)` only when
  every capital is right.
- Evaluation: `EVAL_TASKS` fresh tasks per half, each in both forms,
  greedy; one result row per task.
"""

import json
import random
import statistics
import subprocess
from math import comb
from pathlib import Path
from typing import Any, Optional

from sequence_hooks_training import capitals_task as task

ARMS = {
    "A": "every node (PromiseTreeGRPOTrainer)",
    "B": "roots only (child rows left out)",
    "C": "sequential form",
}
HALVES = ("rewarded", "heldout")
FORMS = ("parallel", "sequential")
CELLS = tuple(f"{half}_{form}" for half in HALVES for form in FORMS)
# Splits the held-out countries into the rewarded and held-out halves.
RL_SPLIT_SEED = 29
# Countries per task, in training and in the evaluation (a tree of 4 to 7
# sequences: a step's rows fit this machine's memory beside other work).
MIN_ITEMS, MAX_ITEMS = 3, 6
# At most 0.1 < 1/6, a capital's share in the largest task: the path term
# never outweighs a capital.
BONUS_WEIGHT = 0.1
# Fresh evaluation draws (never used in training or the earlier run).
EVAL_SEEDS = {"rewarded": 5000, "heldout": 6000}
EVAL_TASKS = 150
# Room past the longest right answer (about 190 tokens in the sequential
# form of 6 countries): a text cut here is degenerate, not long.
EVAL_MAX_TOKENS = 320

# The pass criteria (docs/rl.md): P1 A's gain over B's on rewarded
# countries; P2 A keeps held-out accuracy, its form and no more cut
# texts; P3 A's critical path; P4 A's accuracy against C's.
P1_MIN_GAIN_OVER_B = 0.05
P2_MAX_HELDOUT_DROP = 0.03
P2_MIN_ONE_CHILD_PER_COUNTRY = 0.97
# Where the starting model is already below that (0.913 on the held-out
# half, measured before any training), the share may fall by this much.
P2_MAX_ONE_CHILD_DROP = 0.03
P3_MAX_PATH_RATIO_TO_C = 0.7
P4_MAX_DEFICIT_TO_C = 0.02

# What a part of the results (before, A, B, C) holds as recorded; every
# other figure is recomputed from these by `summarize`.
RAW_KEYS = ("commit", "code_dirty", "steps", "minutes", "settings", "log",
            "eval_seconds", "per_task", "common_set_scores")
# The files the experiment's code is: a part records whether they differed
# from its commit when it ran (parts recorded before these scripts moved
# from models/ to rl/experiment/ checked them at their old paths; a
# part records only the commit and that flag, never the paths).
CODE_FILES = ("rl/experiment/rl_capitals.py", "rl/experiment/rl_eval.py",
              "rl/experiment/rl_experiment.py", "rl/experiment/rl_seeds.py",
              "rl/experiment/rl_token_scores.py",
              "training/sequence_hooks_training/capitals_task.py",
              "rl/vllm_sequence_hooks_rl", "v1/vllm_sequence_hooks",
              "common/sequence_hooks")


def split_held_out() -> tuple[list[str], list[str]]:
    """The countries training rewards and those it never sees.

    Returns:
        The rewarded half and the held-out half of
        `capitals_task.HELD_OUT_COUNTRIES`, each sorted.
    """
    countries = list(task.HELD_OUT_COUNTRIES)
    random.Random(RL_SPLIT_SEED).shuffle(countries)
    half = len(countries) // 2
    return sorted(countries[:half]), sorted(countries[half:])


def training_tasks(num_tasks: int, seed: int,
                   parallel: bool) -> list[task.Task]:
    """The training tasks, the same countries in the same order for every
    arm.

    Args:
        num_tasks: How many.
        seed: The draw's seed.
        parallel: The form (False for arm C).

    Returns:
        Tasks over the rewarded countries.
    """
    rng = random.Random(seed)
    rewarded, _ = split_held_out()
    return [
        task.Task(
            task.make_task(rng, rewarded, True,
                           rng.randint(MIN_ITEMS, MAX_ITEMS)).countries,
            parallel) for _ in range(num_tasks)
    ]


def evaluation_tasks(num_tasks: int = EVAL_TASKS) -> list[dict]:
    """The evaluation's tasks: per half, ``num_tasks`` fresh draws of 3 to
    6 countries (sizes in turn), each in both forms.

    Args:
        num_tasks: Tasks per half and form.

    Returns:
        Rows with ``half``, ``form`` and ``countries``, ordered by half,
        then form; a task's index is its id in the per-task results.
    """
    rows = []
    for half, countries in zip(HALVES, split_held_out()):
        rng = random.Random(EVAL_SEEDS[half])
        sizes = range(MIN_ITEMS, MAX_ITEMS + 1)
        drawn = [
            task.make_task(rng, countries, True,
                           sizes[i % len(sizes)]).countries
            for i in range(num_tasks)
        ]
        rows += [{
            "half": half,
            "form": form,
            "countries": list(names)
        } for form in FORMS for names in drawn]
    return rows


def capitals_share(countries: list[str], text: str) -> float:
    """Share of ``countries`` whose capital the conclusion of ``text``
    gives exactly."""
    right = task.answers_correct(task.Task(tuple(countries), True), text)
    return sum(right) / len(right)


def path_bonus(countries: list[str], text: str, critical_path: int,
               max_tokens: int) -> float:
    """The critical-path term: paid only when every capital is right.

    Args:
        countries: The task's countries.
        text: The root's final text (children's sentences merged in).
        critical_path: Its decoding steps (`PromiseNode.critical_path`;
            a text with no tree: its tokens).
        max_tokens: The completion limit.

    Returns:
        ``BONUS_WEIGHT * max(0, 1 - critical_path / max_tokens)`` when
        every capital is right, else 0.
    """
    if capitals_share(countries, text) < 1:
        return 0.0
    return BONUS_WEIGHT * max(0.0, 1 - critical_path / max_tokens)


def sign_test_p(wins: int, losses: int) -> float:
    """The exact two-sided sign test (ties left out beforehand).

    Args:
        wins: Cases that went one way.
        losses: Cases that went the other.

    Returns:
        How likely a split at least this uneven is if both ways are
        equally likely; 1.0 when there are no cases.
    """
    n, low = wins + losses, min(wins, losses)
    tail = sum(comb(n, i) for i in range(low + 1)) / 2**n
    return min(1.0, 2 * tail)


def signed_rank_test_p(differences: list[float]) -> float:
    """The exact two-sided Wilcoxon signed-rank test's p-value.

    Zero differences are dropped; tied absolute values get their mean
    rank; the p-value counts, over all 2^n equally likely assignments of
    signs to the ranks, those whose positive rank sum is at least as far
    from its mean n(n+1)/4 as the observed one.

    Args:
        differences: Paired differences (one a country).

    Returns:
        The two-sided p-value (1.0 when every difference is 0).
    """
    values = sorted(abs(d) for d in differences if d != 0)
    if not values:
        return 1.0
    # Twice each mean rank: whole numbers, ties included.
    doubled: dict[float, int] = {}
    start = 0
    while start < len(values):
        end = start
        while end < len(values) and values[end] == values[start]:
            end += 1
        doubled[values[start]] = start + 1 + end
        start = end
    nonzero = [d for d in differences if d != 0]
    ranks = [doubled[abs(d)] for d in nonzero]
    observed = sum(rank for rank, d in zip(ranks, nonzero) if d > 0)
    # Ways to reach each doubled positive rank sum.
    ways = {0: 1}
    for rank in ranks:
        grown = dict(ways)
        for total, count in ways.items():
            grown[total + rank] = grown.get(total + rank, 0) + count
        ways = grown
    centre = sum(ranks) / 2
    extreme = sum(count for total, count in ways.items()
                  if abs(total - centre) >= abs(observed - centre))
    return extreme / 2**len(ranks)


def cell_figures(tasks: list[dict], rows: list[dict]) -> dict:
    """The listed metrics of one half and form.

    Args:
        tasks: The cell's tasks (`evaluation_tasks` rows).
        rows: Their per-task results, in the same order.

    Returns:
        ``tasks``; ``accuracy`` (capitals the conclusion gives, per
        country); ``sentence_accuracy`` (the item sentences'); ``all_right``
        (share of tasks); ``one_child_per_country`` (share; parallel
        only); ``cut`` (texts ended by the token limit);
        ``median_critical_path`` (all tasks) and ``mean_critical_path``
        (uncut); ``path_over_tokens`` (uncut: critical paths over sampled
        tokens, summed).
    """
    countries = sum(len(t["countries"]) for t in tasks)
    uncut = [r for r in rows if not r["cut"]]
    figures = {
        "tasks":
        len(rows),
        "accuracy":
        sum(sum(r["right"]) for r in rows) / countries,
        "sentence_accuracy":
        sum(sum(r["sentences"]) for r in rows) / countries,
        "all_right":
        sum(all(r["right"]) for r in rows) / len(rows),
        "cut":
        sum(r["cut"] for r in rows),
        "median_critical_path":
        statistics.median(r["critical_path"] for r in rows),
        "mean_critical_path":
        (statistics.fmean(r["critical_path"]
                          for r in uncut) if uncut else None),
        "path_over_tokens":
        (sum(r["critical_path"]
             for r in uncut) / sum(r["tokens"]
                                   for r in uncut) if uncut else None),
    }
    if tasks[0]["form"] == "parallel":
        figures["one_child_per_country"] = sum(
            r["children"] == len(t["countries"])
            for t, r in zip(tasks, rows)) / len(rows)
    return figures


def country_accuracy(tasks: list[dict], rows: list[dict]) -> dict[str, float]:
    """Per country, the share of its appearances the conclusion got
    right."""
    right: dict[str, list[int]] = {}
    for t, r in zip(tasks, rows):
        for country, ok in zip(t["countries"], r["right"]):
            right.setdefault(country, []).append(int(ok))
    return {c: sum(v) / len(v) for c, v in sorted(right.items())}


def country_changes(tasks: list[dict], before: list[dict],
                    after: list[dict]) -> dict:
    """Countries as the unit: each country's accuracy before and after
    on the same tasks, and a sign test over the countries that moved.

    Args:
        tasks: The cell's tasks.
        before: Their results before training.
        after: Their results after it.

    Returns:
        ``per_country`` (country -> [before, after]), ``up``, ``down``,
        ``same`` and ``sign_test_p``.
    """
    old = country_accuracy(tasks, before)
    new = country_accuracy(tasks, after)
    up = sum(new[c] > old[c] for c in old)
    down = sum(new[c] < old[c] for c in old)
    return {
        "per_country": {
            c: [old[c], new[c]]
            for c in old
        },
        "up": up,
        "down": down,
        "same": len(old) - up - down,
        "sign_test_p": sign_test_p(up, down),
    }


def part_figures(tasks: list[dict], rows: list[dict]) -> dict:
    """One checkpoint's figures from its per-task results.

    Args:
        tasks: `evaluation_tasks`' rows.
        rows: The checkpoint's results, one per task.

    Returns:
        Per cell (``rewarded_parallel``, ...), its `cell_figures`, and
        ``median_critical_path`` per form over the rewarded half.
    """
    figures = {}
    for cell in CELLS:
        index = [
            i for i, t in enumerate(tasks)
            if f"{t['half']}_{t['form']}" == cell
        ]
        figures[cell] = cell_figures([tasks[i] for i in index],
                                     [rows[i] for i in index])
    figures["median_critical_path"] = {
        form: figures[f"rewarded_{form}"]["median_critical_path"]
        for form in FORMS
    }
    return figures


def _criterion(value: Any, threshold: Any, met: bool) -> dict:
    return {"value": value, "threshold": threshold, "met": met}


def criteria(before: dict, arms: dict[str, dict]) -> dict:
    """P1 to P4 from the figures (None where an arm is missing).

    Args:
        before: The starting model's `part_figures`.
        arms: Arm -> its `part_figures`.

    Returns:
        ``P1`` to ``P4``, each with ``value``, ``threshold`` and ``met``.
    """
    a, b, c = (arms.get(arm) for arm in ARMS)

    def change(arm: dict, cell: str, key: str = "accuracy") -> float:
        return arm[cell][key] - before[cell][key]

    result: dict[str, Optional[dict]] = dict.fromkeys(("P1", "P2", "P3", "P4"))
    if a and b:
        gap = (change(a, "rewarded_parallel") - change(b, "rewarded_parallel"))
        result["P1"] = _criterion(gap, P1_MIN_GAIN_OVER_B, gap
                                  >= P1_MIN_GAIN_OVER_B)
    if a:
        value = {
            "heldout_parallel_change":
            change(a, "heldout_parallel"),
            "heldout_sequential_change":
            change(a, "heldout_sequential"),
            "cut_change":
            sum(a[cell]["cut"] - before[cell]["cut"] for cell in CELLS),
        }
        threshold = {
            "heldout_parallel_change": -P2_MAX_HELDOUT_DROP,
            "heldout_sequential_change": -P2_MAX_HELDOUT_DROP,
            "cut_change": 0,
        }
        for half in HALVES:
            key = f"one_child_per_country_{half}"
            value[key] = a[f"{half}_parallel"]["one_child_per_country"]
            threshold[key] = min(
                P2_MIN_ONE_CHILD_PER_COUNTRY,
                before[f"{half}_parallel"]["one_child_per_country"] -
                P2_MAX_ONE_CHILD_DROP)
        met = (value["cut_change"] <= 0
               and all(value[key] >= threshold[key]
                       for key in threshold if key != "cut_change"))
        result["P2"] = _criterion(value, threshold, met)
    if a and c:
        path = a["median_critical_path"]["parallel"]
        value = {
            "median_critical_path": path,
            "over_before": path / before["median_critical_path"]["parallel"],
            "over_c": path / c["median_critical_path"]["sequential"],
        }
        threshold = {"over_before": 1.0, "over_c": P3_MAX_PATH_RATIO_TO_C}
        result["P3"] = _criterion(
            value, threshold, value["over_before"] <= 1.0
            and value["over_c"] <= P3_MAX_PATH_RATIO_TO_C)
        gap = (a["rewarded_parallel"]["accuracy"] -
               c["rewarded_sequential"]["accuracy"])
        result["P4"] = _criterion(gap, -P4_MAX_DEFICIT_TO_C, gap
                                  >= -P4_MAX_DEFICIT_TO_C)
    return result


def summarize(results: dict) -> dict:
    """The summary file from its recorded parts, every figure recomputed
    from the per-task results.

    Args:
        results: ``tasks`` (`evaluation_tasks`' rows), ``before`` and
            ``arms`` (arm -> part), each part with `RAW_KEYS` (figures
            already there are dropped and recomputed).

    Returns:
        ``commit`` (the starting model's evaluation's), ``tasks``,
        ``before`` and ``arms`` with their figures, per arm the
        country-level changes per cell (``countries``) and its KL,
        ``criteria``, the arms' ``comparisons`` and ``packing`` (tree
        packing's cost, if measured).
    """
    tasks = results["tasks"]

    def part(raw: dict) -> dict:
        kept = {k: raw[k] for k in RAW_KEYS if k in raw}
        if "per_task" in kept:
            kept.update(part_figures(tasks, kept["per_task"]))
        return kept

    before = part(results["before"]) if results.get("before") else None
    arms = {}
    for name, raw in sorted(results.get("arms", {}).items()):
        arms[name] = part(raw)
        arms[name]["kl"] = mean_kl(raw.get("log", []))
        if before and "per_task" in raw:
            arms[name]["countries"] = {
                cell:
                country_changes(
                    [t for t in tasks if f"{t['half']}_{t['form']}" == cell], [
                        r for t, r in zip(tasks, before["per_task"])
                        if f"{t['half']}_{t['form']}" == cell
                    ], [
                        r for t, r in zip(tasks, raw["per_task"])
                        if f"{t['half']}_{t['form']}" == cell
                    ])
                for cell in CELLS
            }
    evaluated = {n: a for n, a in arms.items() if "per_task" in a}
    return {
        "commit": (before or {}).get("commit"),
        "arms": arms,
        "before": before,
        "criteria": criteria(before, evaluated) if before else None,
        "comparisons": comparisons(tasks, evaluated),
        # Measured apart from the arms (`rl_packing.py`), kept as written.
        **{
            key: results[key]
            for key in ("packing", ) if key in results
        },
        "tasks": tasks,
    }


def comparisons(tasks: list[dict], arms: dict[str, dict]) -> dict:
    """Countries as the unit between arms on the rewarded half, each in
    its trained form: A against B (P1's), A against C (P4's).

    Args:
        tasks: `evaluation_tasks`' rows.
        arms: Arm -> its part with ``per_task``.

    Returns:
        ``A_over_B`` and ``A_over_C`` where both arms are there, each
        `country_changes` from the other arm to A (``up``: countries A
        gets right more often).
    """

    def cell(arm: str, form: str) -> tuple[list[dict], list[dict]]:
        index = [
            i for i, t in enumerate(tasks)
            if t["half"] == "rewarded" and t["form"] == form
        ]
        return ([tasks[i]
                 for i in index], [arms[arm]["per_task"][i] for i in index])

    result = {}
    for other, form in (("B", "parallel"), ("C", "sequential")):
        if "A" in arms and other in arms:
            cell_tasks, a_rows = cell("A", "parallel")
            _, other_rows = cell(other, form)
            # The same countries in the same order in both forms.
            result[f"A_over_{other}"] = country_changes(
                cell_tasks, other_rows, a_rows)
    return result


def dumps(summary: Any, indent: int = 0) -> str:
    """The summary as JSON that reads and diffs well: objects one key a
    line, every list on one line (a task, a per-task row, a log entry a
    line in the lists of those).

    Args:
        summary: `summarize`'s output (or any part of it).
        indent: The depth it is written at.

    Returns:
        JSON text that `json.loads` reads back as ``summary``.
    """
    pad = " " * (indent + 1)
    if isinstance(summary, dict) and summary:
        items = [
            f"{pad}{json.dumps(key)}: {dumps(value, indent + 1)}"
            for key, value in summary.items()
        ]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    if (isinstance(summary, list) and summary
            and all(isinstance(item, dict) for item in summary)):
        rows = [pad + json.dumps(item) for item in summary]
        return "[\n" + ",\n".join(rows) + "\n" + " " * indent + "]"
    return json.dumps(summary)


def mean_kl(log: list[dict], last: int = 10) -> Optional[float]:
    """TRL's logged KL to the reference model, averaged over an arm's
    last ``last`` steps (None when it logged none)."""
    kls = [entry["kl"] for entry in log if "kl" in entry]
    return statistics.fmean(kls[-last:]) if kls else None


def code_state(root: Path) -> tuple[str, bool]:
    """The checkout's commit and whether the experiment's code differs
    from it.

    Args:
        root: The repository.

    Returns:
        The commit's hash and whether any of `CODE_FILES` has changes
        not committed.
    """
    commit = subprocess.run(["git", "rev-parse", "HEAD"],
                            cwd=root,
                            check=True,
                            capture_output=True,
                            text=True).stdout.strip()
    changed = subprocess.run(["git", "status", "--porcelain", *CODE_FILES],
                             cwd=root,
                             check=True,
                             capture_output=True,
                             text=True).stdout.strip()
    return commit, bool(changed)
