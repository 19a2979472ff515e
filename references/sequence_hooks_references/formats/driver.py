# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Runs controllers written as generators of calls, many at once.

A controller's rollout yields the calls of its next step (a list of
``(prompt, params)``) and is sent their completions, in order; its return
value is its result. `drive` serves every rollout's step with one backend
call, so that one engine batch decodes all of them; `together` runs
several rollouts as one (a parent's children).
"""

from collections.abc import Callable, Generator
from typing import Any

Calls = list[tuple[Any, dict[str, Any]]]
Rollout = Generator[Calls, list, Any]


def drive(rollouts: list[Rollout],
          generate: Callable[[list, list[dict[str, Any]]], list]) -> list:
    """Runs ``rollouts`` to their ends; returns their results in order.

    Args:
        rollouts: Not yet started generators of calls.
        generate: Decodes prompts with their parameters, at once.
    """
    step = _lockstep(rollouts)
    try:
        calls = next(step)
        while True:
            calls = step.send(
                generate([c[0] for c in calls], [c[1] for c in calls]))
    except StopIteration as stop:
        return stop.value


def together(rollouts: list[Rollout]) -> Generator[Calls, list, list]:
    """Runs ``rollouts`` as one rollout whose steps are all of theirs
    (``yield from together(...)`` returns their results in order)."""
    return (yield from _lockstep(rollouts))


def _lockstep(rollouts: list[Rollout]) -> Generator[Calls, list, list]:
    results: list = [None] * len(rollouts)
    waiting: dict[int, Calls] = {}

    def advance(i: int, sent) -> None:
        try:
            waiting[i] = (next(rollouts[i])
                          if sent is None else rollouts[i].send(sent))
        except StopIteration as stop:
            results[i] = stop.value
            waiting.pop(i, None)

    for i in range(len(rollouts)):
        advance(i, None)
    while waiting:
        order = [(i, call) for i, calls in waiting.items() for call in calls]
        done = yield [call for _, call in order]
        for i in list(waiting):
            advance(i, [d for (j, _), d in zip(order, done) if j == i])
    return results
