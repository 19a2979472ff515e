# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The toy task of models/threadweaver-toy, written in ThreadWeaver's format.

ThreadWeaver's own toy task is the product of 5-8 integers in [0, 1000];
a 0.7 M-parameter model cannot multiply such numbers, so this one asks for
the product's last digit. The prompt splits the integers into labelled
groups (``;`` between groups, ``|`` between rounds of outlines)::

    1: 347 82 914 ; 2: 5 6 | 3: 33 7

The model outlines each round's groups, its controller forks one
``<Thread>`` per outline label, each thread multiplies its group's last
digits, and the model concludes from the threads' results::

    <Parallel>
    <Outlines>
    <Outline>1: 347 82 914</Outline>
    <Outline>2: 5 6</Outline>
    </Outlines>
    <Thread>
    1: 1*7=7 7*2=4 4*4=6
    </Thread><Thread>
    2: 1*5=5 5*6=0
    </Thread>
    </Parallel>
    ...
    1*6=6 6*0=0 ...
    answer 0

The training data provokes every case the controller has: a group holding
the integer 0 makes its thread answer 0 and end the whole answer (a branch
that hits EOS); a prompt may repeat a label (the controller keeps the first
group of each label, and so does the data); letter labels are no labels to
the controller's regex (the model then writes the threads itself); a single
group is solved with no ``<Parallel>`` at all; ``|`` makes two rounds.
"""

import random
import re
from dataclasses import dataclass

from transformers import PreTrainedTokenizerFast

# yapf conflicts with isort for this import
# yapf: disable
from sequence_hooks_testkit.formats.threadweaver_format import (CLOSURE,
                                                                CONTINUATION,
                                                                FINAL,
                                                                first_header,
                                                                later_header,
                                                                outline_labels)
# yapf: enable
from sequence_hooks_training.toy_tokenizer import EOS, word_level, wrapped

# ThreadWeaver's added special tokens (threadweaver_sft/src/utils.py,
# add_and_init_special_tokens), in its order.
FORMAT_TOKENS = [
    "<Think>", "</Think>", "<Parallel>", "</Parallel>", "<Outlines>",
    "</Outlines>", "<Outline>", "</Outline>", "<Thread>", "</Thread>",
    "<Conclusion>", "</Conclusion>"
]
LETTERS = "abcdefgh"
# Every word, digit, white-space character and sign is one token, so the
# text's tokens are the concatenation of its pieces' tokens.
PIECES = [str(d) for d in range(10)
          ] + list(LETTERS) + [" ", "\n", ":", ";", "|", "*", "=", "answer"]
SPLIT = r"[a-z]+|\d|\s|[^\s\da-z]"
ANSWER = "answer"
# The shares of the cases in the training data.
TWO_ROUNDS, ZERO, REPEATED, LETTERS_SHARE, SINGLE = 0.25, 0.1, 0.05, 0.1, 0.08
RANDOM_LABELS = 0.4


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The toy's tokenizer: one token per word, digit, white-space
    character and sign (a lossless round trip), ThreadWeaver's tags as
    special tokens."""
    return wrapped(word_level(PIECES, SPLIT),
                   additional_special_tokens=FORMAT_TOKENS)


@dataclass(frozen=True)
class Group:
    """One outline: its label and its integers."""
    label: str
    numbers: tuple[int, ...]


# A task: its rounds of groups (a single group alone is solved sequentially).
Task = tuple[tuple[Group, ...], ...]


def make_task(rng: random.Random, lo: int = 0, hi: int = 1000) -> Task:
    """A random task of 5 to 8 integers in [lo, hi], split into groups."""
    numbers = [rng.randint(max(lo, 1), hi) for _ in range(rng.randint(5, 8))]
    if rng.random() < ZERO:
        numbers[rng.randrange(len(numbers))] = 0
    if rng.random() < SINGLE:
        return ((Group("1", tuple(numbers)), ), )
    rounds = 2 if rng.random() < TWO_ROUNDS else 1
    count = rng.randint(2 * rounds, min(4 * rounds, len(numbers)))
    cuts = sorted(rng.sample(range(1, len(numbers)), count - 1))
    parts = [
        tuple(numbers[a:b]) for a, b in zip([0] + cuts, cuts + [len(numbers)])
    ]
    labels = _labels(rng, count)
    groups = [Group(lab, part) for lab, part in zip(labels, parts)]
    split = rng.randint(2, count - 2) if rounds == 2 else count
    return tuple(r for r in (tuple(groups[:split]), tuple(groups[split:]))
                 if r)


def _labels(rng: random.Random, count: int) -> list[str]:
    if rng.random() < LETTERS_SHARE:
        return list(LETTERS[:count])
    if rng.random() < RANDOM_LABELS:
        labels = [str(n) for n in sorted(rng.sample(range(1, 20), count))]
    else:
        labels = [str(n) for n in range(1, count + 1)]
    if rng.random() < REPEATED:
        i = rng.randrange(1, count)
        labels[i] = labels[i - 1]
    return labels


def prompt_of(task: Task) -> str:
    """The task's prompt, ending with a newline."""
    return " | ".join(" ; ".join(f"{g.label}: " + " ".join(map(str, g.numbers))
                                 for g in groups) for groups in task) + "\n"


def last_digit_of_product(numbers) -> int:
    """The answer: the last digit of the product of ``numbers``."""
    digit = 1
    for n in numbers:
        digit = digit * n % 10
    return digit


def chain(digits) -> tuple[str, int]:
    """The running product of ``digits`` mod 10, step by step, from 1."""
    steps, value = [], 1
    for d in digits:
        steps.append(f"{value}*{d}={value * d % 10}")
        value = value * d % 10
    return " ".join(steps), value


def thread_text(group: Group) -> tuple[str, bool]:
    """What the thread of ``group`` writes after its header (with its
    closing tag) and whether it ends the answer (a 0 among its integers)."""
    if 0 in group.numbers:
        return f" 0\n{ANSWER} 0{EOS}", True
    steps, _ = chain(n % 10 for n in group.numbers)
    return f" {steps}\n</Thread>", False


def outlines_text(groups) -> str:
    """What the model writes to open a round, through ``</Outlines>``."""
    lines = "".join(f"<Outline>{g.label}: " + " ".join(map(str, g.numbers)) +
                    "</Outline>\n" for g in groups)
    return f"<Parallel>\n<Outlines>\n{lines}</Outlines>"


def conclusion_text(results: list[int]) -> str:
    """What the model writes after the last round's ``</Parallel>``."""
    steps, value = chain(results)
    return f"{steps}\n{ANSWER} {value}{EOS}"


@dataclass(frozen=True)
class Piece:
    """A run of text in a training sequence; ``trained`` if the model
    writes it (else the prompt or the controller gives it)."""
    text: str
    trained: bool


def pieces(task: Task) -> tuple[list[Piece], list[tuple[int, list[Piece]]]]:
    """The task's training pieces, as ThreadWeaver trains (one combined
    sequence plus one per branch, each branch seeing only its prefix).

    Returns:
        The main sequence's pieces (the prompt, then what the controller
        ends with), and the branches trained apart: each as the number of
        main pieces it sees, then its header and its thread.
    """
    main = [Piece(prompt_of(task), False)]
    apart: list[tuple[int, list[Piece]]] = []
    if len(task) == 1 and len(task[0]) == 1:
        steps, value = chain(n % 10 for n in task[0][0].numbers)
        main.append(Piece(f"{steps}\n{ANSWER} {value}{EOS}", True))
        return main, apart
    results: list[int] = []
    for number, groups in enumerate(task):
        opening = "" if number == 0 else "</Parallel>\n"
        main.append(Piece(opening + outlines_text(groups), True))
        if not outline_labels(outlines_text(groups)):
            # No label for the controller: the model writes the threads.
            body = ""
            for i, g in enumerate(groups):
                text, eos = thread_text(g)
                body += ("\n" if i == 0 else "") + f"<Thread>\n{g.label}:"
                body += text
                if eos:
                    main.append(Piece(body, True))
                    return main, apart
            main.append(Piece(body + "\n", True))
            results += [_result(g) for g in groups]
            continue
        ended = _round(main, apart, groups, results)
        if ended:
            main.append(Piece(FINAL, False))
            return main, apart
        main.append(Piece(CONTINUATION, False))
    main.append(Piece("</Parallel>\n" + conclusion_text(results), True))
    return main, apart


def _result(group: Group) -> int:
    return last_digit_of_product(n % 10 for n in group.numbers)


def _round(main, apart, groups, results) -> bool:
    """Appends one fork/join round; returns whether a thread ended."""
    first_of = {}
    for g in groups:
        first_of.setdefault(g.label, g)
    fork = len(main)
    ended = False
    for i, (label, group) in enumerate(first_of.items()):
        text, eos = thread_text(group)
        ended |= eos
        header = first_header(label) if i == 0 else later_header(label)
        joined = text[:-len(EOS)] + CLOSURE if eos else text
        if i == 0 and not eos:
            main += [Piece(header, False), Piece(text, True)]
        else:
            apart.append(
                (fork, [Piece(first_header(label), False),
                        Piece(text, True)]))
            main += [Piece(header + joined, False)]
        results.append(0 if eos else _result(group))
    return ended


def answer_of(task: Task) -> int:
    """The expected answer (what a correct trace concludes)."""
    numbers = []
    for groups in task:
        seen = set()
        for g in groups:
            # The controller forks the first group of a numeric label.
            if g.label not in seen or not g.label.isdigit():
                numbers += g.numbers
            seen.add(g.label)
    return last_digit_of_product(numbers)


def parse_answer(text: str):
    """The answer a trace gives (its last ``answer D``), or None."""
    found = re.findall(rf"{ANSWER} (\d)", text)
    return int(found[-1]) if found else None
