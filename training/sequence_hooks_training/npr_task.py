# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The task of models/npr-toy, in NPR's format (`spell_task` has the task).

The prompt lists 2 to 4 words, or one. The model writes a guideline with
one plan per word; the engine forks one step per plan label (the "\\n",
then per label ``"<step>\\n{label}:"``, the step, the "\\n" after it),
then forces ``"<takeaway>\\n"``; the model lists each step's result and
answers::

    cat tree ox                                      (prompt)
    <guideline>
    <plan>1: cat</plan>
    <plan>2: tree</plan>
    <plan>3: ox</plan>
    </guideline>
    <step>                                           (engine: "\\n<step>\\n1:")
    1: cat = c a t so t
    </step>
    <step>
    2: tree = t r e e so e
    </step>
    <step>
    3: ox = o x so x
    </step>
    <takeaway>                                       (engine)
    1: t 2: e 3: x
    </takeaway>
    answer t e x</s>

A prompt of one word is answered directly (``cat = c a t so t`` and the
answer). NPR's blocks do not nest.
"""

import random

from transformers import PreTrainedTokenizerFast

from sequence_hooks_training import spell_task as spell
from sequence_hooks_training.spell_task import FORCED, SAMPLED, Piece
from sequence_hooks_training.toy_tokenizer import EOS

# NPR's tags, each a special token of the toy's tokenizer.
TAGS = [
    "<guideline>", "</guideline>", "<plan>", "</plan>", "<step>", "</step>",
    "<takeaway>", "</takeaway>"
]
MAX_WORDS = 4


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The toy's tokenizer (`spell_task.build_tokenizer` with NPR's tags)."""
    return spell.build_tokenizer(TAGS)


def make_task(rng: random.Random) -> list[str]:
    """A random task: one word (`spell_task.SINGLE` of them) or 2 to
    `MAX_WORDS` distinct words."""
    if rng.random() < spell.SINGLE:
        return spell.sample_words(rng, 1)
    return spell.sample_words(rng, rng.randint(2, MAX_WORDS))


def prompt_of(words: list[str]) -> str:
    """The task's prompt: its words, then a newline."""
    return " ".join(words) + "\n"


def forking_answer(words: list[str], rng: random.Random,
                   replaced: float) -> list[Piece]:
    """The answer to a task of several words: the guideline, a step per
    word (``replaced``: the share of steps whose result is replaced), the
    takeaway and the answer line."""
    labels = [str(k) for k in range(1, len(words) + 1)]
    plans = "".join(f"<plan>{k}: {w}</plan>\n" for k, w in zip(labels, words))
    out = [
        Piece(f"<guideline>\n{plans}</guideline>", SAMPLED),
        Piece("\n", FORCED)
    ]
    results = []
    for label, word in zip(labels, words):
        work, result = spell.result_pieces(word, rng, replaced)
        results.append(result)
        out += [Piece(f"<step>\n{label}:", FORCED), *work]
        out += [Piece("\n</step>", SAMPLED), Piece("\n", FORCED)]
    takeaway = " ".join(f"{k}: {r}" for k, r in zip(labels, results))
    return out + [
        Piece("<takeaway>\n", FORCED),
        Piece(f"{takeaway}\n</takeaway>\n{spell.answer_text(results)}" + EOS,
              SAMPLED)
    ]


# The task's training sequence, piece by piece (`spell_task.sequence_of`).
pieces = spell.sequence_of(prompt_of, forking_answer)


def answer_of(words: list[str]) -> list[str]:
    """The expected answer: the words' last letters."""
    return [w[-1] for w in words]


def expected_text(words: list[str]) -> str:
    """What a perfect model's answer is, after the prompt."""
    return "".join(p.text for p in pieces(words, random.Random(0))[1:])


def forks(words: list[str]) -> bool:
    """Whether a perfect model's answer forks."""
    return len(words) > 1
