# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The "expand" task that the embedded model (models/expand) was trained on.

The prompt lists k groups of 5 words, separated by "then". The parent
writes one `<promise>` per group, then `<sync>`. The child of the i-th
promise (it starts with `<child>`) writes every word of group i four times
(20 words), then "so" and its answer, the group's first word, and ends.
The engine merges the children's texts into the parent, whose conclusion
lists the answers it reads there. Training, evaluation, the demo and their
tests share these definitions.
"""

import random

from sequence_hooks_testkit.tiny_model import CHILD, PROMISE, SYNC

SEPARATOR = "then"
# Precedes a child's answer.
MARKER = "so"
GROUP_SIZES = (2, 3, 4)
GROUP_WORDS = 5
REPEAT = 4
# Share of children whose answer the parent sees replaced in training.
REPLACED = 0.3
CONTENT = [
    "cat", "dog", "bird", "fish", "tree", "sun", "moon", "star", "red", "blue",
    "green", "big", "small", "old", "new", "yes", "no", "up", "down", "left",
    "right"
]


def make_task(rng: random.Random) -> list[list[str]]:
    """A random task: 2 to 4 groups of `GROUP_WORDS` content words."""
    k = rng.choice(GROUP_SIZES)
    return [rng.choices(CONTENT, k=GROUP_WORDS) for _ in range(k)]


def prompt_of(groups: list[list[str]]) -> str:
    """The task's prompt: the groups, separated by "then"."""
    return f" {SEPARATOR} ".join(" ".join(g) for g in groups)


def child_text(group: list[str]) -> str:
    """What the child of ``group`` writes: each word `REPEAT` times, then
    "so" and its answer (the group's first word)."""
    words = [w for w in group for _ in range(REPEAT)]
    return " ".join(words + [MARKER, group[0]])


def conclusion_of(child_texts: list[str]) -> str:
    """The parent's conclusion: each child's answer, read off its text."""
    return " ".join(text.split()[-1] for text in child_texts)


def expected_parent_text(groups: list[list[str]]) -> str:
    """The parent's text as the hooked engine produces it (words only)."""
    texts = [child_text(g) for g in groups]
    return " ".join(texts + [conclusion_of(texts)])


def examples(tokenizer, groups: list[list[str]], rng: random.Random):
    """Training rows for one task: the parent's, then each child's.

    Args:
        tokenizer: The tiny word-level tokenizer.
        groups: The task.
        rng: Chooses which answers the parent sees replaced.

    Returns:
        An iterator of (token ids, loss mask) pairs; the mask is 1 where
        the sequence writes the token itself.
    """
    ids = tokenizer.convert_tokens_to_ids
    prompt = tokenizer.encode(prompt_of(groups), add_special_tokens=False)
    k = len(groups)
    texts = [child_text(g) for g in groups]
    seen = [
        text if rng.random() >= REPLACED else
        f"{text.rsplit(' ', 1)[0]} {rng.choice(CONTENT)}" for text in texts
    ]
    merged = tokenizer.encode("\n".join(seen), add_special_tokens=False)
    conclusion = tokenizer.encode(conclusion_of(seen),
                                  add_special_tokens=False)
    eos = tokenizer.eos_token_id
    parent_out = [ids(PROMISE)] * k + [ids(SYNC)]
    tokens = prompt + parent_out + merged + conclusion + [eos]
    # Merged tokens are given by the engine, not predicted.
    mask = ([0] * len(prompt) + [1] * len(parent_out) + [0] * len(merged) +
            [1] * (len(conclusion) + 1))
    yield tokens, mask
    for i, text in enumerate(texts):
        head = prompt + [ids(PROMISE)] * (i + 1) + [ids(CHILD)]
        body = tokenizer.encode(text, add_special_tokens=False) + [eos]
        yield head + body, [0] * len(head) + [1] * len(body)
