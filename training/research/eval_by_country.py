# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where the forms differ, held-out country by country.

Reads reports of `eval_real_model.py` (each names the seeds its tasks
were drawn with) and prints, per held-out country: the tasks that ask
about it, how often its own capital is right in each form's conclusion,
and how many of those tasks were cut at the token limit or did not get
one child per country. Sorted by how far the parallel form is behind, so
the names that cost it most come first; then the forms compared with the
country as the unit.

Usage: .venv/bin/python training/research/eval_by_country.py
    REPORT [REPORT ...]
"""

import argparse
import json
from collections import defaultdict
from typing import Optional

import eval_real_model as evaluation

from sequence_hooks_training import capitals_task as task

FORMS = ("parallel", "sequential")


def check_tasks(tasks: list[task.Task], report: dict) -> None:
    """Raises ValueError unless ``tasks`` are the report's.

    A report keeps, per form, the countries of its first failed tasks
    (up to three), in order: tasks of other seeds, or drawn otherwise,
    name other countries there (the sizes alone cycle alike for every
    seed).
    """
    for form in FORMS:
        rows = report[form]["per_task"]
        if len(rows) != len(tasks):
            raise ValueError(f"the report has {len(rows)} tasks, the seeds "
                             f"give {len(tasks)}")
        failed = [
            list(t.countries) for t, row in zip(tasks, rows)
            if not all(row["conclusion_per_country"])
        ]
        kept = [list(f["countries"]) for f in report[form]["failures"]]
        if failed[:len(kept)] != kept:
            raise ValueError("the seeds give other tasks than the report's: "
                             f"its first failures are {kept}, the seeds' "
                             f"tasks there are {failed[:len(kept)]}")


def tasks_of(report: dict) -> list[task.Task]:
    """The report's tasks, drawn again from the seeds it names.

    Raises:
        ValueError: if the report names no seeds.
    """
    if "seeds" not in report:
        raise ValueError("the report names no seeds (made before "
                         "eval_real_model.py recorded them)")
    return [
        t for seed in report["seeds"] for t in evaluation.held_out_tasks(
            report["tasks_per_seed"], seed, report["confusable"])
    ]


def by_country(tasks: list[task.Task], report: dict) -> dict[str, dict]:
    """Per country, the counts over the tasks that ask about it.

    Args:
        tasks: The report's tasks, in its order.
        report: An `eval_real_model.py` report over ``tasks``.

    Returns:
        Country -> tasks asking about it, its capital right in each form's
        conclusion, tasks cut at the token limit per form (None if the
        report does not say), and tasks whose parallel parent did not
        promise one child per country.
    """
    check_tasks(tasks, report)
    counts: dict[str, dict] = defaultdict(lambda: defaultdict(int))
    rows = {form: report[form]["per_task"] for form in FORMS}
    for i, t in enumerate(tasks):
        for j, country in enumerate(t.countries):
            row = counts[country]
            row["tasks"] += 1
            for form in FORMS:
                row[f"{form}_right"] += rows[form][i][
                    "conclusion_per_country"][j]
                # Reports before the count have no cut flag: None.
                row[f"{form}_cut"] = _added(
                    row[f"{form}_cut"],
                    rows[form][i].get("cut_at_token_limit"))
            row["not_one_child_per_country"] += not rows["parallel"][i][
                "one_child_per_country"]
    return {country: dict(row) for country, row in counts.items()}


def _added(count: Optional[int], more: Optional[int]) -> Optional[int]:
    """``count + more``, or None if either is unknown."""
    return None if count is None or more is None else count + more


def merged(tables: list[dict[str, dict]]) -> dict[str, dict]:
    """The per-country counts of several reports, added up (None where
    one of them has None)."""
    total: dict[str, dict] = defaultdict(lambda: defaultdict(int))
    for table in tables:
        for country, row in table.items():
            for key, value in row.items():
                total[country][key] = _added(total[country][key], value)
    return {country: dict(row) for country, row in total.items()}


def countries_each_form_wins(table: dict[str, dict]) -> dict:
    """The forms compared with the held-out country as the unit.

    Whether a capital comes out right depends mostly on its country and
    the form, little on the task: most countries are right in nearly
    every task that asks about them or in nearly none. The same country
    in different tasks is then not an independent trial, and the paired
    test of `eval_real_model.py`, which counts it once per task,
    overstates the evidence. Here each country counts once, for the form
    whose conclusion gives its capital more often.

    Args:
        table: Per-country counts, as `by_country` returns them.

    Returns:
        The countries each form wins, the ties, and the sign test's p.
    """
    parallel = sum(row["parallel_right"] > row["sequential_right"]
                   for row in table.values())
    sequential = sum(row["parallel_right"] < row["sequential_right"]
                     for row in table.values())
    return {
        "countries_parallel_ahead": parallel,
        "countries_sequential_ahead": sequential,
        "countries_tied": len(table) - parallel - sequential,
        "sign_test_p": evaluation.sign_test_p(parallel, sequential)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", metavar="REPORT")
    args = parser.parse_args()
    tables = []
    for path in args.reports:
        with open(path) as f:
            report = json.load(f)
        tables.append(by_country(tasks_of(report), report))
    table = merged(tables)
    print("country | tasks | parallel right | sequential right | "
          "cut (parallel / sequential) | not one child per country")

    def shown(count) -> str:
        return "-" if count is None else str(count)

    for country, row in sorted(table.items(),
                               key=lambda item: item[1]["parallel_right"] -
                               item[1]["sequential_right"]):
        print(f"{country} | {row['tasks']} | {row['parallel_right']} | "
              f"{row['sequential_right']} | {shown(row['parallel_cut'])} / "
              f"{shown(row['sequential_cut'])} | "
              f"{row['not_one_child_per_country']}")
    print(json.dumps(countries_each_form_wins(table)))


if __name__ == "__main__":
    main()
