# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The promise/sync lifecycle, written once for every engine.

`PromiseCoordinator` owns every decision of a promise tree's life. It is a
"sans-IO" core (`sequence_hooks.actions`): an engine feeds it events and
carries out the actions each returns, in order, where it already holds its
step's context; the engine's side does only that engine's mechanics (how
a fork shares KV, how a park keeps blocks, how a resume prefills). The V0
fork, the V1 plugin and the client-side join each carry them out.

Events: `sampled` (a member's last token, which may be `promise` or
`sync`), `finished` and `aborted`, each returning its actions (the table:
docs/architecture.md). Queries: which outputs a user sees (`is_child`),
what a scheduler should put first (`on_critical_path`).

Positions: an event's ``length`` is the member's whole token count (its
context and own tokens, the sampled token included), in one consistent
count per engine. The coordinator uses only differences and the model
length, so it never needs to know how an engine stores a sequence.

Child ids and seeds: `sequence_hooks.actions.child_request_id` and
`derive_seed`.
"""

import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

from sequence_hooks.actions import (MERGED_TOKEN_LOGPROB, Abort, Action,
                                    EngineQueries, Fork, MemberResult, Park,
                                    ReportTree, RequestParams, Resume,
                                    StartTree, child_request_id, derive_seed)
from sequence_hooks.members import Member, TreeRecord
from sequence_hooks.metrics import NoMetrics
from sequence_hooks.special_kwargs import SpecialKwargs
from sequence_hooks.texts import merged_text, without_hook_tokens
from sequence_hooks.tree import LiveNode, LiveTree


class PromiseCoordinator:
    """Every promise/sync decision of one engine's trees.

    Args:
        special_kwargs: The hook configuration, resolved to ids.
        queries: What the coordinator asks the engine (read-only).
        max_model_len: The engine's longest sequence.
        hook_token_strings: The hook tokens' strings, removed from texts.
        metrics: `SequenceHookMetrics` to update; None: none.
    """

    # Whether every request is a tree's root from its arrival (the
    # engine then reports it: `arrived`); here a tree starts at its first
    # promise.
    trees_start_at_arrival = False

    def __init__(self,
                 special_kwargs: SpecialKwargs,
                 queries: EngineQueries,
                 max_model_len: int,
                 hook_token_strings: Sequence[str],
                 metrics=None):
        self.special_kwargs = special_kwargs
        self.queries = queries
        self.max_model_len = max_model_len
        self.hook_token_ids = special_kwargs.hook_token_ids
        self.hook_token_strings = list(hook_token_strings)
        self.metrics = metrics if metrics is not None else NoMetrics()
        # Every member of a live tree, by request id.
        self._members: dict[str, Member] = {}
        # When each parked member was parked, by request id.
        self._parked: dict[str, float] = {}

    @classmethod
    def for_tokenizer(cls,
                      special_kwargs: SpecialKwargs,
                      queries: EngineQueries,
                      max_model_len: int,
                      tokenizer: Any,
                      metrics=None) -> "PromiseCoordinator":
        """The coordinator of an engine whose tokenizer spells the hook
        tokens (a Hugging Face tokenizer: `convert_ids_to_tokens`).

        Args:
            special_kwargs: The hook configuration, resolved to ids.
            queries: What the coordinator asks the engine (read-only).
            max_model_len: The engine's longest sequence.
            tokenizer: The engine's tokenizer.
            metrics: The hook metrics (`SequenceHookMetrics`), if exported.

        Returns:
            The coordinator.
        """
        return cls(
            special_kwargs, queries, max_model_len,
            tokenizer.convert_ids_to_tokens(
                sorted(special_kwargs.hook_token_ids)), metrics)

    # Queries.

    @property
    def forking_token_id(self) -> Optional[int]:
        """The token whose sampling may start a tree (`<promise>`)."""
        return self.special_kwargs.promise_token_id

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
        """When each parked member was parked (`time.monotonic()`)."""
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
        """Where a live member's own tokens start (its length then)."""
        return self._members[member_id].start

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

    def sampled(self, member_id: str, token_id: int, length: int,
                params: Callable[[], RequestParams]) -> list[Action]:
        """A member sampled ``token_id``: `<promise>` and `<sync>` are the
        events `promise` and `sync`, any other token is none.

        Args:
            member_id: The sampling member (any request the first time).
            token_id: The token it sampled last.
            length: Its token count, the token included.
            params: Reads its request's parameters (for a promise only).

        Returns:
            The actions to carry out, in order.
        """
        if token_id == self.special_kwargs.promise_token_id:
            return self.promise(member_id, length, params())
        if token_id == self.special_kwargs.sync_token_id:
            return self.sync(member_id, length)
        return []

    def promise(self, member_id: str, length: int,
                params: RequestParams) -> list[Action]:
        """A member sampled `<promise>`: spawns a child unless a limit
        says no (the promise then stays an ordinary token).

        Args:
            member_id: The promising member (a root the first time).
            length: Its token count, the promise included.
            params: Its request's parameters (read for a new root only).

        Returns:
            `StartTree` at a root's first promise, then its `Fork`, if any.
        """
        actions: list[Action] = []
        member = self._members.get(member_id)
        if member is None:
            member = self._track_root(member_id, params)
            actions.append(StartTree(member_id, member.tree.state))
        tree, node = member.tree.state, member.node
        special_kwargs = self.special_kwargs
        if (len(node.children) >= special_kwargs.max_children_per_sequence
                or tree.num_spawned >= special_kwargs.max_children_per_request
                or node.depth >= special_kwargs.max_depth):
            tree.num_refused += 1
            self.metrics.promises_refused.inc()
            return actions
        marker = special_kwargs.child_role_token_id
        seed = (None if member.seed is None else derive_seed(
            member.seed, f"child-{len(node.children)}"))
        actions.append(
            self._fork(member, length, () if marker is None else (marker, ),
                       seed, member.tree.params.max_tokens))
        return actions

    def sync(self, member_id: str, length: int) -> list[Action]:
        """A member sampled `<sync>`: merges its unmerged children if all
        finished, else parks it until they have.

        Args:
            member_id: The syncing member.
            length: Its token count, the sync included.

        Returns:
            `Resume` (a merge) or `Park`; none: `<sync>` was an ordinary
            token (no unmerged child, or not a tree member).
        """
        member = self._members.get(member_id)
        if member is None:
            return []
        node = member.node
        pending = node.unmerged_children()
        if not pending:
            return []
        if all(child.is_finished for child in pending):
            return self._merge(member, length)
        return [self._park(member, length)]

    def finished(self, member_id: str, reason: str,
                 result: MemberResult) -> list[Action]:
        """A member finished: records its result, aborts its unfinished
        descendants, wakes its parked parent when its siblings are done,
        and reports a root's tree.

        Args:
            member_id: The finished member.
            reason: "stop" or "length".
            result: What it produced.

        Returns:
            `Abort` of its live descendants, if any, then `ReportTree` (a
            root) or its parent's `Resume` (its last awaited child).
        """
        member = self._members.get(member_id)
        if member is None or member.node.is_finished:
            return []
        tree, node = member.tree.state, member.node
        actions = self._abort_below(node)
        token_ids = list(result.token_ids)
        text = result.text
        if text is None:
            text = self.queries.decode(
                member_id,
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
        self.metrics.children_running.dec()
        parent = node.parent
        if (parent.parked_since is not None and not parent.is_finished
                and all(child.is_finished
                        for child in parent.unmerged_children())):
            parent_member = self._members[parent.request_id]
            actions.extend(
                self._merge(parent_member, parent_member.parked_length))
        return actions

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

    # Transitions.

    def _track_root(self, root_id: str, params: RequestParams) -> Member:
        """Starts tracking a request's tree at its first promise."""
        state = LiveTree(root=LiveNode(root_id))
        member = Member(TreeRecord(state, params, [root_id]), state.root,
                        params.prompt_len, params.seed)
        self._members[root_id] = member
        return member

    def _fork(self,
              member: Member,
              length: int,
              context_tokens: tuple[int, ...],
              seed: Optional[int],
              max_tokens: Optional[int],
              stop_token_ids: tuple[int, ...] = (),
              label: Optional[str] = None) -> Fork:
        """Records a child of ``member`` forked at ``length``: its fork."""
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
                    label=label)
        child = tree.record_child(member.node, fork.request_id,
                                  length - member.start, label)
        self._members[fork.request_id] = Member(member.tree, child,
                                                length + len(context_tokens),
                                                seed)
        member.tree.member_ids.append(fork.request_id)
        self.metrics.promises_spawned.inc()
        self.metrics.children_running.inc()
        return fork

    def _park(self, member: Member, length: int) -> Park:
        """Parks ``member`` at ``length`` until its children finish."""
        member.parked_length = length
        member.node.parked_since = time.monotonic()
        self._parked[member.node.request_id] = member.node.parked_since
        self.metrics.syncs_blocked.inc()
        self.metrics.parents_parked.inc()
        return Park(member.node.request_id)

    def _room(self, member: Member, length: int) -> int:
        """Tokens a merge may append, leaving one to sample within the
        budget and the model length."""
        room = self.max_model_len - length
        max_tokens = member.tree.params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - (length - member.start))
        return max(room - 1, 0)

    def _merge(self, member: Member, length: int) -> list[Action]:
        """Takes the unmerged children's texts: the member's resume."""
        tree, node = member.tree.state, member.node
        children = tree.take_unmerged(node)
        self._unpark(node)
        text = merged_text(children, self.special_kwargs.merge_separator)
        token_ids = self.queries.encode(node.request_id,
                                        text)[:self._room(member, length)]
        tree.record_merged_tokens(node, length - member.start, len(token_ids))
        self.metrics.merged_tokens.inc(len(token_ids))
        seed = None
        if member.seed is not None and self.queries.reseeds_on_resume(
                node.request_id, len(token_ids)):
            seed = member.seed = derive_seed(member.seed,
                                             f"resume-{node.num_merged}")
        return [
            Resume(node.request_id, tuple(token_ids), MERGED_TOKEN_LOGPROB,
                   seed)
        ]

    def _abort_below(self, node: LiveNode) -> list[Action]:
        """Records a node's unfinished descendants aborted, deepest first.

        Each is recorded "abort" (its tree is complete when its root
        finishes); the engine is asked to abort those it has not finished
        already (a finish it has not reported yet is then void).
        """
        doomed = [
            self._members[child.request_id]
            for child in node.live_descendants()
        ]
        for target in doomed:
            self._record_abort(target)
        live = tuple(
            target.node.request_id for target in doomed
            if not self.queries.engine_finished(target.node.request_id))
        return [Abort(live)] if live else []

    def _record_abort(self, member: Member) -> None:
        member.tree.state.record_abort(member.node)
        self._unpark(member.node)
        if member.node.parent is not None:
            self.metrics.children_running.dec()

    def _unpark(self, node: LiveNode) -> None:
        """Observes how long ``node`` was parked; it is parked no more."""
        if node.parked_since is not None:
            self.metrics.blocked_time.observe(time.monotonic() -
                                              node.parked_since)
            self.metrics.parents_parked.dec()
            node.parked_since = None
            del self._parked[node.request_id]

    def _forget(self, member: Member) -> None:
        """Drops a finished tree's records (its snapshot lives on)."""
        for member_id in member.tree.member_ids:
            del self._members[member_id]
