# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A per-request logits processor that scripts promise/sync programs.

A plan maps a sequence's *role path* to the tokens it must sample, step by
step: `()` is the request's own sequence, `(1,)` the child of its second
promise, `(1, 0)` that child's first child, and so on. `None` in a plan
leaves the step to the model (greedy, with hook tokens and EOS masked); a
plan that runs out forces EOS. Children inherit the processor through
`SamplingParams.clone`, and each sequence works out its role from its own
output tokens: the `<child>` role markers and the promises before them.
`SlowScriptedHooks` also paces the engine (a minimum time per step), so
that requests are still running when a test acts on the server.
"""

import copy
import time
from collections.abc import Sequence
from typing import Optional

import torch

RolePath = tuple[int, ...]
Plan = list[Optional[int]]


class ScriptedHooks:
    """Forces each sequence's tokens by its role path's plan.

    Args:
        plans: Tokens to sample per role path; None = model's choice.
        promise_id: The `<promise>` token id.
        child_id: The role marker every child starts with.
        eos_id: Forced when a plan runs out.
        masked_ids: Ids never chosen on a free step (hook tokens, EOS).
        role: Fixed role path for a plain engine (the reference), which
            sees the context as prompt and so cannot infer it.
        step: The plan step a fixed-role processor starts at.
    """

    def __init__(self,
                 plans: dict[RolePath, Plan],
                 promise_id: int,
                 child_id: int,
                 eos_id: int,
                 masked_ids: Sequence[int],
                 role: Optional[RolePath] = None,
                 step: int = 0):
        self.plans = plans
        self.promise_id = promise_id
        self.child_id = child_id
        self.eos_id = eos_id
        self.masked_ids = list(masked_ids)
        self.fixed_role = role
        self.role = role
        self.step = step

    def clone(self) -> "ScriptedHooks":
        clone = ScriptedHooks(self.plans, self.promise_id, self.child_id,
                              self.eos_id, self.masked_ids, self.fixed_role)
        clone.role, clone.step = self.role, self.step
        return clone

    def role_of(self, output_ids: Sequence[int]) -> RolePath:
        """The role path told by a sequence's output tokens."""
        role: RolePath = ()
        promises = 0
        for token_id in output_ids:
            if token_id == self.promise_id:
                promises += 1
            elif token_id == self.child_id:
                role, promises = role + (promises - 1, ), 0
        return role

    def __call__(self, output_ids: list[int],
                 logits: torch.Tensor) -> torch.Tensor:
        if self.fixed_role is None:
            role = self.role_of(output_ids)
            if role != self.role:
                # A child's first step: its clone still had the parent's.
                self.role, self.step = role, 0
        plan = self.plans.get(self.role, [])
        forced = plan[self.step] if self.step < len(plan) else self.eos_id
        self.step += 1
        if forced is None:
            logits[self.masked_ids] = -float("inf")
        else:
            logits.fill_(-float("inf"))
            logits[forced] = 0.0
        return logits


def from_role_plans(role_plans: list,
                    promise_id: int,
                    child_id: int,
                    eos_id: int,
                    masked_ids: list,
                    role: Optional[list] = None,
                    step: int = 0) -> ScriptedHooks:
    """Builds `ScriptedHooks` from JSON-friendly arguments.

    The OpenAI server builds per-request logits processors from a qualified
    name and JSON arguments (`logits_processors` in the request body, with
    `--logits-processor-pattern`), and JSON has no tuple keys.

    Args:
        role_plans: `[[role path as a list, plan], ...]`.
        promise_id: The `<promise>` token id.
        child_id: The role marker.
        eos_id: Forced when a plan runs out.
        masked_ids: Ids never chosen on a free step.
        role: Fixed role path, for a stock server (the client-side join
            runs each sequence's segments as requests of their own).
        step: The plan step a fixed-role processor starts at.
    """
    return ScriptedHooks({
        tuple(path): plan
        for path, plan in role_plans
    },
                         promise_id,
                         child_id,
                         eos_id,
                         masked_ids,
                         role=None if role is None else tuple(role),
                         step=step)


class SlowScriptedHooks(ScriptedHooks):
    """`ScriptedHooks` that make each engine step last ``step_seconds``.

    Each sequence's calls (one an engine step) are at least
    ``step_seconds`` apart: the first sequence of a step sleeps out the
    rest, and the others of that step find their time already up. So a
    plan of N free tokens keeps its sequence (and its request's stream)
    in flight for N * ``step_seconds`` or more, however many sequences
    share the steps (the shutdown tests).

    Args:
        step_seconds: The least time between two steps of a sequence.
        Others: as `ScriptedHooks`.
    """

    def __init__(self, *args, step_seconds: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_seconds = step_seconds
        self.last_call = 0.0

    def clone(self) -> "SlowScriptedHooks":
        # Every attribute as the base class's clone keeps it, plus the pace.
        return copy.copy(self)

    def __call__(self, output_ids: list[int],
                 logits: torch.Tensor) -> torch.Tensor:
        wait = self.last_call + self.step_seconds - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self.last_call = time.monotonic()
        return super().__call__(output_ids, logits)


def slow_from_role_plans(step_seconds: float, **kwargs) -> SlowScriptedHooks:
    """Builds `SlowScriptedHooks` from JSON-friendly arguments.

    Args:
        step_seconds: The least time between two steps of a sequence.
        kwargs: As `from_role_plans`.
    """
    plain = from_role_plans(**kwargs)
    return SlowScriptedHooks(plain.plans,
                             plain.promise_id,
                             plain.child_id,
                             plain.eos_id,
                             plain.masked_ids,
                             role=plain.fixed_role,
                             step=plain.step,
                             step_seconds=step_seconds)
