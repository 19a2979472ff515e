# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The task of models/multiverse-toy, in Multiverse's format, with nested
blocks (`spell_task` has the task).

The prompt lists 2 to 4 items, or one word; an item is a word or a pair
of words (``cat+sun``). The model writes a goal with one outline per item;
the engine forks one path per outline label (the "\\n", then per label
``"<Path>\\n{label}:"``, the path, the "\\n" after it), then forces
``"<Conclusion>\\n"``; the model lists each path's result, closes the
block and answers. A pair's path opens a block of its own, one sub-path
per word (labels ``1.1``, ``1.2``), and ends with its conclusion's
letters::

    cat+sun ox                                       (prompt)
    <Parallel>
    <Goal>
    <Outline>1: cat+sun</Outline>
    <Outline>2: ox</Outline>
    </Goal>
    <Path>                                           (engine: "\\n<Path>\\n1:")
    1: cat+sun
    <Parallel>
    <Goal>
    <Outline>1.1: cat</Outline>
    <Outline>1.2: sun</Outline>
    </Goal>
    <Path>                                           (engine)
    1.1: cat = c a t so t
    </Path>
    <Path>
    1.2: sun = s u n so n
    </Path>
    <Conclusion>                                     (engine)
    1.1: t 1.2: n
    </Conclusion>
    </Parallel>
    so t n
    </Path>
    <Path>
    2: ox = o x so x
    </Path>
    <Conclusion>                                     (engine)
    1: t n 2: x
    </Conclusion>
    </Parallel>
    answer t n x</s>

A prompt of one word is answered directly, with no block.
"""

import random
from typing import Union

from transformers import PreTrainedTokenizerFast

from sequence_hooks_training import spell_task as spell
from sequence_hooks_training.spell_task import FORCED, SAMPLED, Piece
from sequence_hooks_training.toy_tokenizer import EOS

# Multiverse's added special tokens (train/utils.py), in its order.
TAGS = [
    "<Think>", "</Think>", "<Parallel>", "</Parallel>", "<Goal>", "</Goal>",
    "<Outline>", "</Outline>", "<Path>", "</Path>", "<Conclusion>",
    "</Conclusion>"
]
MAX_ITEMS, MAX_PAIRS = 4, 2
# The chance that an item of a prompt of several is a pair.
PAIR = 0.35

# A word, or a pair of words (its path opens a nested block).
Item = Union[str, tuple[str, str]]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The toy's tokenizer (`spell_task.build_tokenizer` with Multiverse's
    tags)."""
    return spell.build_tokenizer(TAGS)


def make_task(rng: random.Random) -> list[Item]:
    """A random task: one word (`spell_task.SINGLE` of them) or 2 to
    `MAX_ITEMS` items, each a pair with chance `PAIR` (at most
    `MAX_PAIRS`), all words distinct."""
    if rng.random() < spell.SINGLE:
        return spell.sample_words(rng, 1)
    count = rng.randint(2, MAX_ITEMS)
    pairs = min(MAX_PAIRS, sum(rng.random() < PAIR for _ in range(count)))
    chosen = rng.sample(range(count), pairs)
    words = iter(spell.sample_words(rng, count + pairs))
    return [(next(words), next(words)) if i in chosen else next(words)
            for i in range(count)]


def item_text(item: Item) -> str:
    """An item as the prompt and the outlines write it."""
    return item if isinstance(item, str) else "+".join(item)


def prompt_of(items: list[Item]) -> str:
    """The task's prompt: its items, then a newline."""
    return " ".join(map(item_text, items)) + "\n"


def block(items: list[Item], prefix: str, rng: random.Random,
          replaced: float) -> tuple[list[Piece], list[str]]:
    """One block, ``<Parallel>`` through ``</Parallel>``, and its letters.

    Args:
        items: Its items, one path each.
        prefix: Its labels' prefix ("" at top level, "1." in path 1).
        rng: Draws the replaced results.
        replaced: The share of word paths whose result is replaced.
    """
    labels = [f"{prefix}{k}" for k in range(1, len(items) + 1)]
    outlines = "".join(f"<Outline>{k}: {item_text(i)}</Outline>\n"
                       for k, i in zip(labels, items))
    out = [
        Piece(f"<Parallel>\n<Goal>\n{outlines}</Goal>", SAMPLED),
        Piece("\n", FORCED)
    ]
    results = []
    for label, item in zip(labels, items):
        out.append(Piece(f"<Path>\n{label}:", FORCED))
        if isinstance(item, str):
            work, result = spell.result_pieces(item, rng, replaced)
            out += work
            letters = [result]
        else:
            out.append(Piece(f" {item_text(item)}\n", SAMPLED))
            inner, letters = block(list(item), f"{label}.", rng, replaced)
            out += inner
            out.append(Piece(f"\n{spell.SO} {' '.join(letters)}", SAMPLED))
        results.append(letters)
        out += [Piece("\n</Path>", SAMPLED), Piece("\n", FORCED)]
    conclusion = " ".join(f"{k}: {' '.join(r)}"
                          for k, r in zip(labels, results))
    out += [
        Piece("<Conclusion>\n", FORCED),
        Piece(f"{conclusion}\n</Conclusion>\n</Parallel>", SAMPLED)
    ]
    return out, [letter for r in results for letter in r]


def forking_answer(items: list[Item], rng: random.Random,
                   replaced: float) -> list[Piece]:
    """The answer to a task that forks: its block (``replaced``: the
    share of word paths whose result is replaced) and the answer line."""
    inner, letters = block(items, "", rng, replaced)
    return inner + [Piece(f"\n{spell.answer_text(letters)}" + EOS, SAMPLED)]


# The task's training sequence, piece by piece (`spell_task.sequence_of`).
pieces = spell.sequence_of(prompt_of, forking_answer)


def words_of(items: list[Item]) -> list[str]:
    """The task's words, pairs flattened."""
    return [w for i in items for w in ([i] if isinstance(i, str) else i)]


def answer_of(items: list[Item]) -> list[str]:
    """The expected answer: the words' last letters."""
    return [w[-1] for w in words_of(items)]


def expected_text(items: list[Item]) -> str:
    """What a perfect model's answer is, after the prompt."""
    return "".join(p.text for p in pieces(items, random.Random(0))[1:])


def forks(items: list[Item]) -> bool:
    """Whether a perfect model's answer forks."""
    return len(items) > 1 or not isinstance(items[0], str)


def nests(items: list[Item]) -> bool:
    """Whether a perfect model's answer holds a nested block."""
    return any(not isinstance(i, str) for i in items)
