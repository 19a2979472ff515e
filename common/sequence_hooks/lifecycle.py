# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The lifecycle of fork/join trees, written once for every engine and
every format.

`Coordinator` owns every record of a tree's life. It is a "sans-IO" core
(`sequence_hooks.actions`): an engine feeds it events and carries out the
actions each returns, in order, where it already holds its step's
context; the engine's side does only that engine's mechanics (how a fork
shares KV, how a park keeps blocks, how a resume prefills). The V0 fork,
the V1 plugin and the client-side join each carry them out.

What a format decides (which token forks, what a join appends) is its
`FormatPolicy`, which the coordinator composes: the policy reads the
events and answers with the coordinator's transitions (`track_root`,
`fork`, `park`, `take_finished_children`, `end` ...); the coordinator
keeps the records, aborts trees and reports them. Formats are plug-ins
(`sequence_hooks.formats`); promise/sync is one of them.

Events: `arrived`, `sampled`, `finished` and `aborted`, each returning its
actions (the table: docs/architecture.md). Queries: which outputs a user
sees (`is_child`), what a scheduler should put first
(`on_critical_path`).

Positions: an event's ``length`` is the member's whole token count (its
context and own tokens, the sampled token included), in one consistent
count per engine. The coordinator uses only differences and the model
length, so it never needs to know how an engine stores a sequence.

Child ids and seeds: `sequence_hooks.actions.child_request_id` and
`derive_seed`.
"""

from collections.abc import Callable, Sequence
from typing import Any, Optional

from sequence_hooks.actions import (Abort, Action, Fork, MemberResult, Park,
                                    ReportTree, RequestParams,
                                    child_request_id)
from sequence_hooks.counts import HookCounts
from sequence_hooks.formats import FormatSetting, format_named
from sequence_hooks.members import Member, TreeRecord
from sequence_hooks.special_kwargs import SpecialKwargs
from sequence_hooks.texts import Texts, TokenizerTexts, without_hook_tokens
from sequence_hooks.tree import LiveNode, LiveTree


class FormatPolicy:
    """A format's decisions, which a `Coordinator` composes: each event's
    answer, built from the coordinator's transitions. This base answers
    as a format that forks nothing; a format overrides what it decides.

    Args:
        coordinator: The coordinator it decides for.
    """

    # The token whose sampling may start a tree (an engine's hot path
    # looks for no other); None: any.
    forking_token_id: Optional[int] = None
    # Whether every request is a tree's root from its arrival (the
    # engine then reports it: `arrived`).
    trees_start_at_arrival = False

    def __init__(self, coordinator: "Coordinator") -> None:
        self.coordinator = coordinator

    def arrived(self, member_id: str, prompt_token_ids: list[int],
                params: RequestParams) -> list[Action]:
        """A request arrived (`Coordinator.arrived`; engines report
        arrivals only to a policy with `trees_start_at_arrival`).

        Returns:
            The actions to carry out, in order.
        """
        return []

    def sampled(self, member_id: str, token_ids: Sequence[int],
                params: Callable[[], RequestParams],
                logprobs: Optional[list]) -> list[Action]:
        """A member sampled a token (`Coordinator.sampled`).

        Returns:
            The actions to carry out, in order.
        """
        return []

    def finished(self, member_id: str, reason: str,
                 result: MemberResult) -> list[Action]:
        """A member of a live tree finished (`Coordinator.finished`): by
        default its end, which `Coordinator.end` records; a format whose
        members make several calls decides here whether this is its end.

        Returns:
            The actions to carry out, in order.
        """
        return self.coordinator.end(member_id, reason, result)

    def children_done(self, member: Member, length: int) -> list[Action]:
        """Every child a parked member waits for has finished: its join.

        Args:
            member: The parked member.
            length: Its token count when it was parked.

        Returns:
            The actions to carry out, in order.
        """
        return []

    def own_start(self, member_id: str) -> Optional[int]:
        """Where a member's current call's own tokens start, if the
        policy moves it (a call made anew); None: where it began."""
        return None

    def forget(self, member: Member) -> None:
        """A tree ended: drops what the policy kept for it.

        Args:
            member: A member of the tree.
        """


class Coordinator:
    """Every record of one engine's trees, in one format.

    It asks the engine nothing: what it reads comes with each event, and
    what it counts (`counts`) an adapter exports.

    Args:
        policy: Makes the format's policy for this coordinator
            (``policy(coordinator)``).
        special_kwargs: The hook configuration, resolved to ids.
        max_model_len: The engine's longest sequence.
        texts: The model's text codec (`sequence_hooks.texts.Texts`): a
            join's text to ids, a member's ids to its text.
        clock: Seconds of a monotonic clock (how long members are
            parked).
        reseeds_on_resume: Whether the engine re-creates a resumed
            member's random generator (V0, which prefills the merged
            tokens anew): a seeded member then gets a new seed at each
            resume (`actions.Resume.seed`).
        hook_token_strings: The hook tokens' strings, removed from texts.
    """

    def __init__(self,
                 policy: Callable[["Coordinator"], FormatPolicy],
                 special_kwargs: SpecialKwargs,
                 max_model_len: int,
                 texts: Texts,
                 *,
                 clock: Callable[[], float],
                 reseeds_on_resume: bool = False,
                 hook_token_strings: Sequence[str] = ()):
        self.special_kwargs = special_kwargs
        self.max_model_len = max_model_len
        self.texts = texts
        self.clock = clock
        self.reseeds_on_resume = reseeds_on_resume
        self.hook_token_ids = special_kwargs.hook_token_ids
        self.hook_token_strings = list(hook_token_strings)
        self.counts = HookCounts()
        # Every member of a live tree, by request id.
        self._members: dict[str, Member] = {}
        # When each parked member was parked, by request id.
        self._parked: dict[str, float] = {}
        self.policy = policy(self)

    @classmethod
    def for_format(cls,
                   special_kwargs: SpecialKwargs,
                   max_model_len: int,
                   tokenizer: Any,
                   *,
                   clock: Callable[[], float],
                   reseeds_on_resume: bool = False) -> "Coordinator":
        """The coordinator of an engine's trees in its configured format
        (`sequence_hooks.formats`).

        Args:
            special_kwargs: The hook configuration, resolved to ids (its
                ``format`` checked at start: `checked_special_kwargs`).
            max_model_len: The engine's longest sequence.
            tokenizer: The engine's (Hugging Face) tokenizer: it spells
                the hook tokens, codes joins' texts, and the format reads
                its tags with it.
            clock: Seconds of a monotonic clock.
            reseeds_on_resume: See the class.

        Returns:
            The coordinator, its format's policy composed.
        """
        fmt = format_named(special_kwargs.format)
        setting = FormatSetting(
            special_kwargs, fmt.read_options(special_kwargs.format_options),
            special_kwargs.tags, tokenizer, max_model_len)
        hook_ids = sorted(special_kwargs.hook_token_ids)
        return cls(lambda coordinator: fmt.policy(coordinator, setting),
                   special_kwargs,
                   max_model_len,
                   TokenizerTexts(tokenizer),
                   clock=clock,
                   reseeds_on_resume=reseeds_on_resume,
                   hook_token_strings=tokenizer.convert_ids_to_tokens(hook_ids)
                   if hook_ids else ())

    # Queries.

    @property
    def forking_token_id(self) -> Optional[int]:
        """The token whose sampling may start a tree."""
        return self.policy.forking_token_id

    @property
    def trees_start_at_arrival(self) -> bool:
        """Whether every request is a tree's root from its arrival (the
        engine then reports it: `arrived`)."""
        return self.policy.trees_start_at_arrival

    def member(self, member_id: str) -> Optional[Member]:
        """The record of a live tree's member; None if none."""
        return self._members.get(member_id)

    def tree_of(self, member_id: str) -> Optional[LiveTree]:
        """The live tree ``member_id`` belongs to; None if none."""
        member = self._members.get(member_id)
        return None if member is None else member.tree.state

    def num_members(self) -> int:
        """Members of live trees (finished ones included)."""
        return len(self._members)

    def is_member(self, member_id: str) -> bool:
        """Whether ``member_id`` is a member of a live tree."""
        return member_id in self._members

    def is_child(self, member_id: str) -> bool:
        """Whether ``member_id`` is a child: its outputs are never shown."""
        member = self._members.get(member_id)
        return member is not None and member.node.parent is not None

    def num_parked(self) -> int:
        """Members parked at a `<sync>`."""
        return len(self._parked)

    def parked_members(self) -> dict[str, float]:
        """When each parked member was parked (by the clock)."""
        return dict(self._parked)

    def root_of(self, member_id: str) -> Optional[str]:
        """The root of the live tree ``member_id`` belongs to; None if
        none."""
        member = self._members.get(member_id)
        return None if member is None else member.tree.state.root.request_id

    def ancestors(self, member_id: str) -> list[str]:
        """A member's parent, its parent's parent..., nearest first."""
        member = self._members.get(member_id)
        found = []
        node = None if member is None else member.node.parent
        while node is not None:
            found.append(node.request_id)
            node = node.parent
        return found

    def is_finished(self, member_id: str) -> bool:
        """Whether ``member_id`` is a member of a live tree that finished
        (its finish is recorded; the tree waits for others)."""
        member = self._members.get(member_id)
        return member is not None and member.node.is_finished

    def own_start(self, member_id: str) -> int:
        """Where a live member's current call's own tokens start."""
        start = self.policy.own_start(member_id)
        return self._members[member_id].start if start is None else start

    def on_critical_path(self, member_id: str) -> bool:
        """Whether a member is work its request is waiting for: a child
        whose parent is parked, or a member that resumed after a merge.

        Args:
            member_id: A live request's id.

        Returns:
            True if a scheduler should put it before new requests.
        """
        member = self._members.get(member_id)
        if member is None:
            return False
        node = member.node
        return node.num_merged > 0 or (node.parent is not None and
                                       node.parent.parked_since is not None)

    # Events.

    def arrived(self, member_id: str, prompt_token_ids: list[int],
                params: RequestParams) -> list[Action]:
        """A request arrived (reported only if `trees_start_at_arrival`).

        Args:
            member_id: Its request id.
            prompt_token_ids: Its prompt.
            params: Its parameters.

        Returns:
            The actions to carry out, in order.
        """
        return self.policy.arrived(member_id, prompt_token_ids, params)

    def sampled(self,
                member_id: str,
                token_ids: Sequence[int],
                params: Callable[[], RequestParams],
                logprobs: Optional[list] = None) -> list[Action]:
        """A member sampled a token: the format's event, if any.

        Args:
            member_id: The sampling member (any request the first time).
            token_ids: Its whole token ids, its context and own tokens,
                the sampled token last (read during the call only; their
                count is the member's length).
            params: Reads its request's parameters (for a new root only).
            logprobs: Its current call's sampled tokens' logprobs so far
                (a format that restarts calls keeps them); None if its
                request asked for none, or the format reads none.

        Returns:
            The actions to carry out, in order.
        """
        return self.policy.sampled(member_id, token_ids, params, logprobs)

    def finished(self, member_id: str, reason: str,
                 result: MemberResult) -> list[Action]:
        """A member's engine request finished: the format's reading of
        it (`FormatPolicy.finished`; by default the member's end).

        Args:
            member_id: The member.
            reason: "stop", "length" or the engine's other reasons.
            result: What it produced.

        Returns:
            The actions to carry out, in order.
        """
        member = self._members.get(member_id)
        if member is None or member.node.is_finished:
            return []
        return self.policy.finished(member_id, reason, result)

    def aborted(self, member_id: str) -> list[Action]:
        """The engine aborted a member's request from outside: the whole
        tree ends, with no report.

        Args:
            member_id: A member of the aborted request (the root, or any
                member when the engine resolves a member to its request).

        Returns:
            `Abort` of the members the engine has not ended, if any.
        """
        member = self._members.get(member_id)
        if member is None or member.node.is_finished:
            return []
        root = member.tree.state.root
        # Members the engine aborted with the request need nothing more.
        actions = self._abort_below(root)
        self._record_abort(self._members[root.request_id])
        self._forget(member)
        return actions

    # Transitions, for the format's policy.

    def track_root(self, root_id: str, params: RequestParams) -> Member:
        """Starts tracking a request's tree (the caller reports
        `StartTree`).

        Args:
            root_id: The request's id.
            params: Its parameters.

        Returns:
            The root's record.
        """
        state = LiveTree(root=LiveNode(root_id))
        member = Member(TreeRecord(state, params, [root_id]), state.root,
                        params.prompt_len, params.seed)
        self._members[root_id] = member
        return member

    def fork(self,
             member: Member,
             length: int,
             context_tokens: tuple[int, ...],
             seed: Optional[int],
             max_tokens: Optional[int],
             stop_token_ids: tuple[int, ...] = (),
             label: Optional[str] = None,
             fresh: bool = False,
             position_shift: Optional[tuple[int, int]] = None) -> Fork:
        """Records a child of ``member`` forked at ``length``.

        Args:
            member: The forking member.
            length: Its token count at the fork.
            context_tokens: Appended to its whole context to make the
                child's; with ``fresh``, the child's whole context.
            seed: The child's seed; None: unseeded.
            max_tokens: The child's own-token budget.
            stop_token_ids: Where it stops besides its request's stop ids.
            label: Its label in the tree.
            fresh: Its context is ``context_tokens`` alone.
            position_shift: Its positions' shift (`Fork.position_shift`).

        Returns:
            The child's `Fork`.
        """
        tree, request = member.tree.state, member.tree.params
        fork = Fork(request_id=child_request_id(tree.root.request_id,
                                                tree.num_spawned),
                    parent_id=member.node.request_id,
                    context_tokens=context_tokens,
                    max_tokens=max_tokens,
                    min_tokens=request.min_tokens,
                    seed=seed,
                    stop=request.stop,
                    stop_token_ids=stop_token_ids,
                    label=label,
                    fresh=fresh,
                    position_shift=position_shift)
        child = tree.record_child(member.node, fork.request_id,
                                  length - member.start, label)
        start = len(context_tokens) if fresh else length + len(context_tokens)
        self._members[fork.request_id] = Member(member.tree, child, start,
                                                seed)
        member.tree.member_ids.append(fork.request_id)
        self.counts.promises_spawned += 1
        self.counts.children_running += 1
        return fork

    def park(self, member: Member, length: int) -> Park:
        """Parks ``member`` at ``length`` until its children finish
        (`FormatPolicy.children_done` is then its event).

        Args:
            member: The member.
            length: Its token count now.

        Returns:
            Its `Park`.
        """
        member.parked_length = length
        member.node.parked_since = self.clock()
        self._parked[member.node.request_id] = member.node.parked_since
        self.counts.syncs_blocked += 1
        self.counts.parents_parked += 1
        return Park(member.node.request_id)

    def take_finished_children(self, member: Member) -> list[LiveNode]:
        """A member's children not merged yet, in fork order, now merged;
        it is parked no more.

        Args:
            member: The member (its children all finished).

        Returns:
            The children's nodes.
        """
        children = member.tree.state.take_unmerged(member.node)
        self._unpark(member.node)
        return children

    def record_merged(self, member: Member, at: int, count: int) -> None:
        """Records ``count`` tokens merged into ``member`` at its own
        token ``at``.

        Args:
            member: The member.
            at: Where they start among its own tokens.
            count: How many.
        """
        member.tree.state.record_merged_tokens(member.node, at, count)
        self.counts.merged_tokens += count

    def end(self, member_id: str, reason: str,
            result: MemberResult) -> list[Action]:
        """A member ends: records its result, aborts its unfinished
        descendants, lets its parked parent join when its siblings are
        done, and reports a root's tree.

        Args:
            member_id: The member.
            reason: "stop", "length" or the engine's other reasons.
            result: What it produced.

        Returns:
            `Abort` of its live descendants, if any, then `ReportTree` (a
            root) or its parent's join (its last awaited child).
        """
        member = self._members[member_id]
        tree, node = member.tree.state, member.node
        actions = self._abort_below(node)
        token_ids = list(result.token_ids)
        text = result.text
        if text is None:
            text = self.texts_of(member).decode(
                [t for t in token_ids if t not in self.hook_token_ids])
        logprobs = cumulative = None
        if result.logprobs is not None:
            merged = {
                i
                for start, count in node.merged_spans
                for i in range(start, start + count)
            }
            logprobs = [
                None if i in merged else entry
                for i, entry in enumerate(result.logprobs)
            ]
            cumulative = sum(entry[token].logprob
                             for token, entry in zip(token_ids, logprobs)
                             if entry is not None)
        tree.record_finish(node, reason, token_ids,
                           without_hook_tokens(text, self.hook_token_strings),
                           logprobs, cumulative)
        self._unpark(node)
        if node.parent is None:
            self._forget(member)
            actions.append(ReportTree(member_id, tree.snapshot()))
            return actions
        self.counts.children_running -= 1
        parent = node.parent
        if (parent.parked_since is not None and not parent.is_finished
                and all(child.is_finished
                        for child in parent.unmerged_children())):
            parent_member = self._members[parent.request_id]
            actions.extend(
                self.policy.children_done(parent_member,
                                          parent_member.parked_length))
        return actions

    def texts_of(self, member: Member) -> Texts:
        """The text codec of a member's request: its own (a LoRA
        adapter's tokenizer), else the model's."""
        return member.tree.params.texts or self.texts

    # Records.

    def _abort_below(self, node: LiveNode) -> list[Action]:
        """Records a node's unfinished descendants aborted, deepest first.

        Each is recorded "abort" (its tree is complete when its root
        finishes); the engine aborts them, skipping those it has finished
        already (a finish it has not reported yet is then void).
        """
        doomed = [
            self._members[child.request_id]
            for child in node.live_descendants()
        ]
        for target in doomed:
            self._record_abort(target)
        return [Abort(tuple(target.node.request_id
                            for target in doomed))] if doomed else []

    def _record_abort(self, member: Member) -> None:
        member.tree.state.record_abort(member.node)
        self._unpark(member.node)
        if member.node.parent is not None:
            self.counts.children_running -= 1

    def _unpark(self, node: LiveNode) -> None:
        """Observes how long ``node`` was parked; it is parked no more."""
        if node.parked_since is not None:
            self.counts.blocked_times.append(self.clock() - node.parked_since)
            self.counts.parents_parked -= 1
            node.parked_since = None
            del self._parked[node.request_id]

    def _forget(self, member: Member) -> None:
        """Drops a finished tree's records (its snapshot lives on)."""
        self.policy.forget(member)
        for member_id in member.tree.member_ids:
            del self._members[member_id]
