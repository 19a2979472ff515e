# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How the real model's task is scored and turned into training rows.

The model card's figures rest on these: a scoring slip once hid the first
merged sentence of every parallel answer. Texts are built from the task's
own helpers, as the engine would return them (hook tokens are not in the
text), then damaged one way at a time.
"""

import json
import random

import eval_by_country
import eval_real_model as evaluation
import pytest
from train_real_model import RowMaker

from sequence_hooks_training import capitals_task as task
from sequence_hooks_training import prepare_base_model as prepare

TASK = task.Task(("Peru", "Guinea-Bissau", "Chile"), True)
CAPITALS = [task.CAPITALS[c] for c in TASK.countries]


def parallel_text(sentences: list[str], list_end: str = task.LIST_END):
    """The parent's text: its list, the merged sentences, the conclusion
    the sentences support."""
    heading = "\n".join(
        task.item_heading(i, c) for i, c in enumerate(TASK.countries))
    given = [task.parse_sentence(s)[1] for s in sentences]
    return (heading + list_end + "\n".join(sentences) +
            task.conclusion_of(list(TASK.countries), given))


@pytest.mark.parametrize("list_end", [task.LIST_END, ""])
def test_a_right_answer_scores_every_country(list_end):
    text = parallel_text(task.expected_sentences(TASK), list_end)
    assert task.answers_correct(TASK, text) == [True, True, True]
    assert task.sentences_correct(TASK, text) == [True, True, True]


def test_a_wrong_child_costs_only_its_country():
    sentences = task.expected_sentences(TASK)
    sentences[1] = task.item_sentence("Guinea-Bissau", "Conakry")
    text = parallel_text(sentences)
    assert task.answers_correct(TASK, text) == [True, False, True]
    assert task.sentences_correct(TASK, text) == [True, False, True]


def test_a_sentence_about_another_country_does_not_count():
    sentences = task.expected_sentences(TASK)
    sentences[2] = "For Chile: the capital city of Peru is Santiago."
    assert task.sentences_correct(
        TASK,
        parallel_text(sentences[:2]) + "\n" +
        sentences[2]) == [True, True, False]


def test_the_conclusion_is_read_by_country_first_pair_counting():
    text = ("So the capital of Chile is Santiago, of Peru is Quito, "
            "of Peru is Lima.")
    assert task.parse_conclusion(text) == {
        "Chile": "Santiago",
        "Peru": "Quito"
    }
    assert task.answers_correct(TASK, text) == [False, False, True]


def test_no_conclusion_scores_nothing():
    text = "\n".join(task.expected_sentences(TASK))
    assert task.parse_conclusion(text) == {}
    assert task.answers_correct(TASK, text) == [False, False, False]


def _form(conclusions: list[list[bool]]) -> dict:
    return {"per_task": [{"conclusion_per_country": c} for c in conclusions]}


def test_paired_counts_discordant_countries_and_tests_them():
    report = {
        "parallel": _form([[True, False, True], [False, False]]),
        "sequential": _form([[True, True, False], [True, True]]),
    }
    # 1 country right only in parallel, 3 only in sequential: P(X <= 1)
    # for X ~ Bin(4, 1/2) is 5/16, doubled.
    assert evaluation.paired(report) == {
        "only_parallel_right": 1,
        "only_sequential_right": 3,
        "sign_test_p": 0.625
    }


def _rows(conclusions: list[list[bool]], cut: list[bool],
          spawned: list[bool]) -> dict:
    return {
        "failures": [],
        "per_task": [{
            "conclusion_per_country": c,
            "cut_at_token_limit": k,
            "one_child_per_country": s
        } for c, k, s in zip(conclusions, cut, spawned)]
    }


def test_by_country_counts_each_country_over_its_tasks():
    tasks = [
        task.Task(("Peru", "Chile"), True),
        task.Task(("Chile", "France", "Peru"), True)
    ]
    report = {
        "parallel":
        _rows([[True, True], [True, True, False]], [False, True],
              [True, False]),
        "sequential":
        _rows([[False, False], [True, True, True]], [False, False],
              [True, True]),
    }
    table = eval_by_country.by_country(tasks, report)
    assert table["Peru"] == {
        "tasks": 2,
        "parallel_right": 1,
        "sequential_right": 1,
        "parallel_cut": 1,
        "sequential_cut": 0,
        "not_one_child_per_country": 1
    }
    assert table["Chile"]["parallel_right"] == 2
    assert table["Chile"]["sequential_right"] == 1
    assert table["France"]["tasks"] == 1
    # Each country once: Chile for parallel, Peru and France tied.
    assert eval_by_country.countries_each_form_wins(table) == {
        "countries_parallel_ahead": 1,
        "countries_sequential_ahead": 0,
        "countries_tied": 2,
        "sign_test_p": 1.0
    }
    with pytest.raises(ValueError, match="the seeds give 1"):
        eval_by_country.by_country(tasks[:1], report)


def test_by_country_leaves_cuts_unknown_in_reports_without_them():
    tasks = [task.Task(("Peru", ), True)]
    report = {
        form: {
            "failures": [],
            "per_task": [{
                "conclusion_per_country": [True],
                "one_child_per_country": True
            }]
        }
        for form in ("parallel", "sequential")
    }
    old = eval_by_country.by_country(tasks, report)
    assert old["Peru"]["parallel_cut"] is None
    new = eval_by_country.by_country(
        tasks, {
            form: _rows([[True]], [True], [True])
            for form in ("parallel", "sequential")
        })
    both = eval_by_country.merged([old, new])
    assert both["Peru"]["tasks"] == 2
    assert both["Peru"]["parallel_right"] == 2
    assert both["Peru"]["parallel_cut"] is None
    assert eval_by_country.merged([new, new])["Peru"]["parallel_cut"] == 2


def test_a_report_gives_back_its_tasks_and_no_others():
    with open(prepare.DELTA / "eval_report.json") as f:
        report = json.load(f)
    tasks = eval_by_country.tasks_of(report)
    assert len(tasks) == 168
    eval_by_country.check_tasks(tasks, report)
    # Same sizes, other countries: the kept failures tell them apart.
    other = eval_by_country.tasks_of(dict(report, seeds=[5000, 6000, 7000]))
    with pytest.raises(ValueError, match="other tasks"):
        eval_by_country.check_tasks(other, report)
    with pytest.raises(ValueError, match="other tasks"):
        eval_by_country.by_country(
            eval_by_country.tasks_of(dict(report, confusable=True)), report)
    with pytest.raises(ValueError, match="names no seeds"):
        eval_by_country.tasks_of({"parallel": report["parallel"]})


def test_confusable_pairs_share_a_word_or_begin_one_another():
    names = [
        "Guinea", "Peru", "Guinea-Bissau", "Niger", "Nigeria", "Sudan",
        "South Sudan", "South Korea"
    ]
    assert task.confusable_pairs(names) == [("Guinea", "Guinea-Bissau"),
                                            ("Niger", "Nigeria"),
                                            ("Sudan", "South Sudan"),
                                            ("South Sudan", "South Korea")]
    # The held-out ones are the four Guinea names, pairwise.
    held_out = task.confusable_pairs(task.HELD_OUT_COUNTRIES)
    assert len(held_out) == 6
    assert all("Guinea" in a and "Guinea" in b for a, b in held_out)


def test_confusable_tasks_hold_one_pair_among_distinct_countries():
    tasks = evaluation.held_out_tasks(14, 9100, confusable=True)
    pairs = task.confusable_pairs(task.HELD_OUT_COUNTRIES)
    for i, t in enumerate(tasks):
        assert len(t.countries) == task.MIN_ITEMS + i % 7
        assert len(set(t.countries)) == len(t.countries)
        assert any(set(pair) <= set(t.countries) for pair in pairs)
    # The default draw is the one the committed reports were made with.
    assert evaluation.held_out_tasks(3, 1000) == [
        task.make_task(rng, task.HELD_OUT_COUNTRIES, True, k)
        for rng in [random.Random(1000)] for k in (2, 3, 4)
    ]


@pytest.fixture(scope="module")
def row_maker():
    from transformers import AutoTokenizer
    return RowMaker(AutoTokenizer.from_pretrained(prepare.prepare_base()),
                    known={"Peru"})


def _untrained_text(row_maker, tokens, targets):
    """The decoded tokens a row does not train, in order."""
    return [
        row_maker.tokenizer.decode([t])
        for t, target in zip(tokens[1:], targets[:-1]) if target == -100
    ]


def test_rows_train_known_capitals_and_give_the_others(row_maker):
    row = row_maker.packed(TASK)
    children = [start for start, _ in row.children] + [len(row.tokens)]
    untrained = [
        "".join(
            _untrained_text(row_maker, row.tokens[start:end],
                            row.targets[start:end]))
        for start, end in zip(children, children[1:])
    ]
    # The capitals of the countries the base does not know are given,
    # Peru's is trained, like every other token a child writes.
    assert untrained == ["", " Bissau", " Santiago"]
    sequential = row_maker.packed(task.Task(TASK.countries, False))
    prompt = len(row_maker.prompt(TASK))
    answer = _untrained_text(row_maker, sequential.tokens[prompt - 1:],
                             sequential.targets[prompt - 1:])
    assert "".join(answer) == " Bissau Santiago"
