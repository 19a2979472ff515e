# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the NPR and Multiverse toys' tasks share (`npr_task`,
`multiverse_task`): spell words, answer their last letters.

The prompt lists words (``cat tree ox`` and a newline). The model plans
one path per word; each path spells its word and names its last letter
(`` tree = t r e e so e``), so paths differ in length with their words
(2 to 6 letters); the block's after-text lists each path's result by its
label and the answer repeats the letters (``answer t e x``). A prompt of
one word is answered with no block at all.

The after-text reads the paths, not the prompt: in a share of the
training paths (`REPLACED`) the result after ``so`` is a random other
letter, which the model is not trained to write but the after-text and
the answer follow.

Every word, letter, digit, white-space character and sign is one token
and the formats' tags are special tokens, so a text's tokens are its
pieces' tokens one after the other.
"""

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerFast

from sequence_hooks_training.toy_tokenizer import EOS, word_level, wrapped

# 2 to 6 letters each.
WORDS = [
    "ox", "ink", "sky", "cat", "dog", "sun", "owl", "tree", "bird", "fish",
    "moon", "star", "lamp", "apple", "horse", "tiger", "river", "cloud",
    "stone", "banana", "orange", "garden", "rabbit", "silver"
]
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# Precedes a path's result; opens the answer.
SO, ANSWER = "so", "answer"
PIECES = list(LETTERS) + WORDS + [str(d) for d in range(10)] + [
    " ", "\n", ":", "=", "+", ".", SO, ANSWER
]
SPLIT = r"[a-z]+|\d|\s|[^\s\da-z]"
# Shares of the training data: prompts of one word (no block), and paths
# whose result is replaced.
SINGLE, REPLACED = 0.12, 0.2

# Who gives a piece of a training sequence: the prompt, the model
# (trained), the engine (forced, not trained), or the model's place with a
# replaced result (not trained: the model would write another letter).
PROMPT, SAMPLED, FORCED, REPLACEMENT = "prompt", "sampled", "forced", "replaced"


@dataclass(frozen=True)
class Piece:
    """A run of text of a training sequence and who gives it."""
    text: str
    role: str


def build_tokenizer(tags: list[str]) -> PreTrainedTokenizerFast:
    """A toy's tokenizer: one token per word, letter, digit, white-space
    character and sign, ``tags`` as special tokens."""
    return wrapped(word_level(PIECES, SPLIT), additional_special_tokens=tags)


def spelling(word: str) -> str:
    """A path's work on ``word``, up to its result: `` tree = t r e e so``."""
    return f" {word} = {' '.join(word)} {SO}"


def result_of(word: str, rng: random.Random, replaced: float) -> str:
    """A path's result: its word's last letter, or with probability
    ``replaced`` another letter."""
    if rng.random() < replaced:
        return rng.choice(LETTERS.replace(word[-1], ""))
    return word[-1]


def result_pieces(word: str, rng: random.Random,
                  replaced: float) -> tuple[list[Piece], str]:
    """The pieces of ``word``'s spelling and result (with its leading
    space), and the result."""
    result = result_of(word, rng, replaced)
    role = SAMPLED if result == word[-1] else REPLACEMENT
    return [Piece(spelling(word), SAMPLED), Piece(f" {result}", role)], result


def direct(word: str) -> list[Piece]:
    """A one-word prompt's answer, with no block."""
    return [
        Piece(
            f"{spelling(word).lstrip()} {word[-1]}\n{ANSWER} {word[-1]}" + EOS,
            SAMPLED)
    ]


def sequence_of(
    prompt_of: Callable[[list], str],
    forking_answer: Callable[[list, random.Random, float], list[Piece]],
) -> Callable[..., list[Piece]]:
    """A toy's `pieces` (`npr_task.pieces`, `multiverse_task.pieces`): the
    prompt, then a one-word task's direct answer or the toy's block.

    Args:
        prompt_of: The toy's prompt of a task.
        forking_answer: The toy's answer to a task that forks (its block
            and the answer line) from the task, the draws and the share
            replaced.

    Returns:
        ``pieces(task, rng, replaced=0.0)``.
    """

    def pieces(task: list,
               rng: random.Random,
               replaced: float = 0.0) -> list[Piece]:
        """The task's training sequence as the engine ends with it, piece
        by piece (prompt, sampled, forced, replaced).

        Args:
            task: The task.
            rng: Draws the replaced results.
            replaced: The share of word paths whose result is replaced.
        """
        out = [Piece(prompt_of(task), PROMPT)]
        if len(task) == 1 and isinstance(task[0], str):
            return out + direct(task[0])
        return out + forking_answer(task, rng, replaced)

    return pieces


def answer_text(letters: list[str]) -> str:
    """The answer line: ``answer t e x``."""
    return f"{ANSWER} {' '.join(letters)}"


def parse_answer(text: str):
    """The letters of the last answer line of ``text`` (None if none)."""
    found = re.findall(rf"{ANSWER}((?: [a-z])+)", text)
    return found[-1].split() if found else None


def sample_words(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct random words."""
    return rng.sample(WORDS, count)
