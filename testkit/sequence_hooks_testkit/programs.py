# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The named promise/sync programs every flavour is proven on.

A program maps role paths to plans (see `scripted_hooks.ScriptedHooks`):
`None` leaves a step to the model, a hook token id forces it.
"""

from sequence_hooks_testkit.scripted_hooks import Plan, RolePath
from sequence_hooks_testkit.tiny_model import HookIds

NONE = None
Program = dict[RolePath, Plan]
# Prompts of the tiny vocabulary for batched runs.
PROMPTS = [
    "the cat sees", "one two three", "big red dog", "a small bird",
    "the sun and the moon", "old tree", "five fish", "green star"
]


def programs(ids: HookIds) -> dict[str, Program]:
    """Named programs: plans per role path.

    Args:
        ids: The hook token ids of the model's tokenizer.

    Returns:
        Each program by name.
    """
    P, S = ids.promise, ids.sync
    return {
        "one promise": {
            (): [NONE, P, NONE, NONE, S, NONE, NONE],
            (0, ): [NONE] * 4,
        },
        "several promises": {
            (): [NONE, P, P, NONE, P, S, NONE],
            (0, ): [NONE] * 3,
            (1, ): [NONE] * 6,
            (2, ): [NONE],
        },
        "nested": {
            (): [NONE, P, NONE, S, NONE],
            (0, ): [NONE, P, NONE, P, S, NONE],
            (0, 0): [NONE] * 3,
            (0, 1): [NONE] * 2,
        },
        "sync before the child finishes": {
            (): [P, S, NONE],
            (0, ): [NONE] * 10,
        },
        "sync after the child finished": {
            (): [P] + [NONE] * 8 + [S, NONE],
            (0, ): [NONE],
        },
        "two rounds": {
            (): [P, NONE, S, NONE, P, P, S, NONE],
            (0, ): [NONE] * 2,
            (1, ): [NONE] * 3,
            (2, ): [NONE] * 1,
        },
        "sync without children": {
            (): [NONE, S, NONE, NONE],
        },
    }


def two_children(ids: HookIds, child_tokens=(3, 4)) -> Program:
    """A parent that promises two children, syncs, writes two more words.

    Args:
        ids: The hook token ids.
        child_tokens: Free tokens of each child before its EOS.
    """
    P, S = ids.promise, ids.sync
    plans = {(): [NONE, P, NONE, P, S, NONE, NONE]}
    for k, n in enumerate(child_tokens):
        plans[(k, )] = [NONE] * n
    return plans
