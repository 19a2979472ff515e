# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The policy of a format whose model forks at a trigger token: a
building block for formats (ThreadWeaver's is
`sequence_hooks.formats.threadweaver`; docs/formats.md, "Adding a
format", builds one on it).

`ForkJoinPolicy`: a member that samples the format's trigger token forks
the branches the format reads from its context, each with its own forced
header tokens and stop ids, and is parked at the trigger; once they have
all finished it gets the join the format builds from their tokens (a
template at token level) and resumes, or ends there (`Conclude`) when the
format, its step limit, the budget or the model length says so. Branches
never fork again. A root's call that ends at one of its request's own
stop ids (not EOS) is followed by another call from its whole context, as
a controller that merges the request's stop ids into its calls makes it.

A format is data plus two functions (`ForkJoinFormat`): which branches a
context forks, and what their results join into.

`TriggerPolicy` is what any policy that forks at a trigger token does
(`ForkJoinPolicy`, and a policy of its own for a format whose join is not
a template, as ThreadWeaver's `SimpleEvalPolicy`).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional, Protocol

from sequence_hooks.actions import (MERGED_TOKEN_LOGPROB, Action, Conclude,
                                    MemberResult, RequestParams, Restart,
                                    Resume, StartTree)
from sequence_hooks.formats import (ARRIVALS, BRANCH_STOPS, CONCLUDE, FORK,
                                    PARK_RESUME, RESTART)
from sequence_hooks.lifecycle import Coordinator, FormatPolicy
from sequence_hooks.members import Member

# What `ForkJoinPolicy`'s actions need of an engine (a format built on it
# declares these as its `Format.needs`).
NEEDS = frozenset(
    {FORK, PARK_RESUME, BRANCH_STOPS, CONCLUDE, RESTART, ARRIVALS})


@dataclass(frozen=True)
class Branch:
    """A branch a trigger forks."""

    label: str
    # Appended to the forking member's whole context: the branch's header.
    context_tokens: tuple[int, ...]
    # Where it stops besides its request's stop ids (kept as its last
    # token).
    stop_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class BranchResult:
    """What a finished branch produced."""

    label: str
    # Its own tokens (after its header), a matched stop id last.
    token_ids: tuple[int, ...]
    # "stop" or "length" (or "abort").
    finish_reason: str


@dataclass(frozen=True)
class Joined:
    """What a join appends to the forking member."""

    token_ids: tuple[int, ...]
    # Whether the member ends after them (the format's final join).
    final: bool


class TriggerFormat(Protocol):
    """A format that forks at a trigger token."""

    # The token whose sampling forks.
    trigger_id: int


class ForkJoinFormat(TriggerFormat, Protocol):
    """A format, as the lifecycle needs it."""

    # Calls a controller makes before it gives up (each run of the
    # member's own decoding and each fork counts one).
    max_steps: int

    def branches(self, context: Sequence[int]) -> list[Branch]:
        """The branches a member forks at the trigger, given its whole
        token ids (the trigger last); none: it decodes on."""
        ...

    def join(self, results: Sequence[BranchResult]) -> Joined:
        """What the branches' results append to their parent."""
        ...


class TriggerPolicy(FormatPolicy):
    """What a policy that forks at its format's trigger token does: the
    engine looks for the trigger alone (`forking_token_id`); a root is
    tracked as its tree's from its first trigger on; a fork's branches
    are capped by the limits; a join reads the branches' results.

    Args:
        coordinator: The coordinator it decides for.
        trigger_format: The format.
    """

    def __init__(self, coordinator: Coordinator,
                 trigger_format: TriggerFormat) -> None:
        super().__init__(coordinator)
        self.format = trigger_format
        # The format's trigger.
        self.forking_token_id = trigger_format.trigger_id

    def _root(self, member_id: str,
              params: Callable[[], RequestParams]) -> tuple[Member, list]:
        """A root at its trigger: its member, and the actions to start
        with: its tree's `StartTree` if this is the root's first (the
        coordinator tracks it from there, with the request's
        ``params``)."""
        member = self.coordinator.member(member_id)
        if member is not None:
            return member, []
        member = self.coordinator.track_root(member_id, params())
        return member, [StartTree(member_id, member.tree.state)]

    def _within_limits(self, member: Member, wanted: list) -> list:
        """The first of ``wanted`` that the limits let ``member``'s fork
        start (`SpecialKwargs.fork_limit`); the others are counted as
        refused."""
        tree = member.tree.state
        limit = self.coordinator.special_kwargs.fork_limit(tree.num_spawned)
        forked = wanted[:limit]
        tree.num_refused += len(wanted) - len(forked)
        return forked

    def _results(self, member: Member) -> list[BranchResult]:
        """``member``'s finished branches' results, taken from the
        coordinator, in fork order."""
        return [
            BranchResult(child.label or "", tuple(child.token_ids),
                         child.finish_reason or "abort")
            for child in self.coordinator.take_finished_children(member)
        ]


class ForkJoinPolicy(TriggerPolicy):
    """The decisions of a format that forks at a trigger token and joins
    by a template.

    Args:
        coordinator: The coordinator it decides for (its
            `special_kwargs`' `max_children_per_sequence` caps the
            branches of one fork).
        fork_join_format: The format.
    """

    # A request whose calls may stop at ids of its own is tracked from
    # its arrival: its first call's end may be no end of the answer.
    trees_start_at_arrival = True

    def __init__(self, coordinator: Coordinator,
                 fork_join_format: ForkJoinFormat) -> None:
        super().__init__(coordinator, fork_join_format)
        # Per forking root, the controller's steps so far.
        self._steps: dict[str, int] = {}
        # Per parked root, its whole token ids at the fork.
        self._contexts: dict[str, tuple[int, ...]] = {}
        # Per root tracked from its arrival, its prompt.
        self._prompts: dict[str, tuple[int, ...]] = {}

    def arrived(self, member_id: str, prompt_token_ids: list[int],
                params: RequestParams) -> list[Action]:
        """A request with stop ids of its own besides EOS is a tree's
        root from here: the engine reports its calls' ends.

        Returns:
            Its `StartTree`, or none (a request with no such stop id).
        """
        if not any(
                params.ends_call_at_own_stop(i)
                for i in params.stop_token_ids):
            return []
        member = self.coordinator.track_root(member_id, params)
        self._prompts[member_id] = tuple(prompt_token_ids)
        return [StartTree(member_id, member.tree.state)]

    def finished(self, member_id: str, reason: str,
                 result: MemberResult) -> list[Action]:
        """A root's call that stopped at one of its request's own stop
        ids (neither EOS nor length) is followed by the next sequential
        call from its whole context (`Restart`), within the step limit,
        the budget and the window; any other finish is the member's
        end.

        Returns:
            The root's `Restart`, or its end's actions.
        """
        coordinator = self.coordinator
        member = coordinator.member(member_id)
        own = tuple(result.token_ids)
        if (member is None or coordinator.is_child(member_id)
                or member_id not in self._prompts or reason != "stop"
                or not own
                or not member.tree.params.ends_call_at_own_stop(own[-1])):
            return coordinator.end(member_id, reason, result)
        steps = self._steps[member_id] = self._steps.get(member_id, 1) + 1
        context = (*self._prompts[member_id], *own)
        budget = member.tree.params.max_tokens
        if (steps > self.format.max_steps
                or len(context) >= coordinator.max_model_len
                or budget is not None and len(own) >= budget):
            return coordinator.end(member_id, reason, result)
        return [
            Restart(member_id, context, (), MERGED_TOKEN_LOGPROB,
                    None if budget is None else budget - len(own))
        ]

    def sampled(self, member_id: str, token_ids: Sequence[int],
                params: Callable[[], RequestParams],
                logprobs: Optional[list]) -> list[Action]:
        """The trigger forks the branches the member's context names and
        parks it; any other token is no event.

        Returns:
            `StartTree` at a request's first trigger; then its `Fork`s and
            its `Park`, or `Conclude` past the step limit; none without a
            branch.
        """
        coordinator = self.coordinator
        if (token_ids[-1] != self.format.trigger_id
                or coordinator.is_child(member_id)):
            return []
        length = len(token_ids)
        member, actions = self._root(member_id, params)
        branches = self.format.branches(token_ids)
        # The trigger ended a call: the next (a fork, or decoding on) is
        # another step.
        steps = self._steps[member_id] = self._steps.get(member_id, 1) + 1
        if steps > self.format.max_steps:
            return actions + [Conclude(member_id, (), MERGED_TOKEN_LOGPROB)]
        # The limits may refuse branches (the controller has none); with
        # none left, the member decodes on as after outlines with no label.
        forked = self._within_limits(member, branches)
        if any(length + len(branch.context_tokens) >= coordinator.max_model_len
               for branch in forked):
            # A branch with no room to sample (the controller's server
            # refuses its call): none forks, the member decodes on to the
            # window.
            forked = []
        if not forked:
            # The controller's next call, sequential again.
            return actions + self._next_call(member, tuple(token_ids), ())
        for branch in forked:
            # Each branch is a call of its own, with the request's seed.
            actions.append(
                coordinator.fork(member, length, branch.context_tokens,
                                 member.seed, None, branch.stop_token_ids,
                                 branch.label))
        actions.append(coordinator.park(member, length))
        # Parked, its tokens stay these until the join.
        self._contexts[member_id] = tuple(token_ids)
        return actions

    def children_done(self, member: Member, length: int) -> list[Action]:
        """The branches' join, by the format's template: the member's
        resume, or its end."""
        coordinator, node = self.coordinator, member.node
        joined = self.format.join(self._results(member))
        root_id = node.request_id
        self._steps[root_id] += 1
        token_ids = joined.token_ids
        budget = member.tree.params.max_tokens
        used = length - member.start
        # The join reaches the model's length or the budget: the answer
        # ends there, as a "length" finish.
        reached = (length + len(token_ids) >= coordinator.max_model_len
                   or budget is not None and used + len(token_ids) >= budget)
        final = (joined.final or reached
                 or self._steps[root_id] > self.format.max_steps)
        if budget is not None:
            token_ids = token_ids[:max(budget - used, 0)]
        coordinator.record_merged(member, used, len(token_ids))
        context = self._contexts.pop(root_id)
        if final:
            return [
                Conclude(root_id, token_ids, MERGED_TOKEN_LOGPROB,
                         "length" if reached else "stop")
            ]
        return self._next_call(member, context, token_ids)

    def _next_call(self, member: Member, context: tuple[int, ...],
                   token_ids: tuple[int, ...]) -> list[Action]:
        """The root's next call after a step, from its whole ``context``
        with ``token_ids`` joined: its resume, or none (no join) for an
        unseeded root. The controller seeds every call with the request's
        seed: on an engine that keeps a resumed request's generator, a
        seeded root's next call is a new one (`Restart`), its budget what
        is left."""
        root_id = member.node.request_id
        length = len(context)
        if member.seed is None or self.coordinator.reseeds_on_resume:
            # No join: the member decodes on, no event.
            return [
                Resume(root_id, token_ids, MERGED_TOKEN_LOGPROB, member.seed)
            ] if token_ids else []
        budget = member.tree.params.max_tokens
        left = (None if budget is None else budget - (length - member.start) -
                len(token_ids))
        return [
            Restart(root_id, (*context, *token_ids), token_ids,
                    MERGED_TOKEN_LOGPROB, left)
        ]

    def forget(self, member: Member) -> None:
        """Drops the tree's step count, parked context and prompt."""
        root_id = member.tree.state.root.request_id
        self._steps.pop(root_id, None)
        self._contexts.pop(root_id, None)
        self._prompts.pop(root_id, None)
