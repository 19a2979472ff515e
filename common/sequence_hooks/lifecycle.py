# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The promise/sync lifecycle, written once for every engine.

`PromiseCoordinator` owns every decision of a promise tree's life; an
engine feeds it events and carries out the actions it asks for through an
`EngineAdapter`, which does only that engine's mechanics (how a fork shares
KV, how a park keeps blocks, how a resume prefills). The V0 fork, the V1
plugin and the client-side join are its three adapters.

Events (engine -> coordinator):
- `sampled(M, token, length, params)`: member M sampled a token, which the
  coordinator tells apart (the engines' adapters call this):
- `promise(M, length, params)`: M sampled `<promise>`;
- `sync(M, length)`: M sampled `<sync>`;
- `finished(M, reason, result)`: M stopped or ran out of room;
- `aborted(M)`: the engine aborted M's request from outside.

Actions (coordinator -> engine, `EngineAdapter`): fork a child of M
(`ChildSpec`: its id, context tokens, budget, seed, stop strings), park M,
resume M with merged tokens and their logprob (`Resume`), abort members,
report a finished root's tree. Queries: which outputs a user sees
(`is_child`), what a scheduler should put first (`on_critical_path`).

Positions: an event's ``length`` is the member's whole token count (its
context and own tokens, the sampled token included), in one consistent
count per engine. The coordinator uses only differences and the model
length, so it never needs to know how an engine stores a sequence.

Child ids: `<root request id>/promise-<k>`, where k counts the children
spawned in the root's tree before this one (0 for the first), whatever
their parents. The root's id is its engine request's (a sample's own id
when a request has `n > 1`), so ids are unique per engine.

Seeds: a seeded request's child gets `derive_seed(parent seed,
"child-<i>")`, i its index among its parent's children; a resume that
re-creates its member's random generator (an engine that prefills merged
tokens anew) gets `derive_seed(seed, "resume-<k>")`, k the member's
children merged so far, this merge's included.
"""

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from sequence_hooks.special_kwargs import SpecialKwargs
from sequence_hooks.tree import LiveNode, LiveTree, TokenLogprobs

# Logprob given to tokens that were appended, not sampled (merged tokens,
# the role marker): they leave the cumulative logprob unchanged.
MERGED_TOKEN_LOGPROB = 0.0


def child_request_id(root_id: str, index: int) -> str:
    """The id of the ``index``-th child spawned in ``root_id``'s tree."""
    return f"{root_id}/promise-{index}"


def derive_seed(seed: int, purpose: str) -> int:
    """A deterministic seed for a child or a resume of a seeded sequence.

    Args:
        seed: The parent's (or resuming member's) seed.
        purpose: What the seed is for, e.g. "child-0" or "resume-1".

    Returns:
        A non-negative 63-bit seed.
    """
    digest = hashlib.blake2b(f"{seed}:{purpose}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def merged_text(children: Sequence[LiveNode], separator: str) -> str:
    """The text a merge appends: the children's texts in promise order."""
    return separator.join(child.text for child in children)


def without_hook_tokens(text: str, hook_token_strings: Sequence[str]) -> str:
    """``text`` with every hook token's string removed.

    Hook tokens show in a detokenized text when they are not special tokens
    of the tokenizer, or special tokens are not skipped.
    """
    for token in hook_token_strings:
        text = text.replace(token, "")
    return text


def encode_merge(tokenizer: Any, text: str) -> list[int]:
    """Token ids of merge text with a Hugging Face tokenizer: text that
    spells a special token stays text, never a control token."""
    return tokenizer.encode(text,
                            add_special_tokens=False,
                            split_special_tokens=True)


def decode_own(tokenizer: Any, token_ids: list[int]) -> str:
    """A member's own text from its tokens with a Hugging Face tokenizer
    (special tokens skipped), where the engine has none."""
    return tokenizer.decode(token_ids, skip_special_tokens=True)


@dataclass(frozen=True)
class RequestParams:
    """What the lifecycle reads of a request: where its own tokens start
    and its sampling parameters."""

    # Its prompt's length: the root's own tokens start there.
    prompt_len: int
    # Own tokens each member may produce (merged ones count); None: up to
    # the model length.
    max_tokens: Optional[int]
    # Own tokens each member produces before it may stop.
    min_tokens: int = 0
    # The request's seed; None if unseeded.
    seed: Optional[int] = None
    # The request's stop strings.
    stop: tuple[str, ...] = ()

    @classmethod
    def of(cls, prompt_len: int, max_tokens: Optional[int],
           sampling_params: Any) -> "RequestParams":
        """What the lifecycle reads of a vLLM request, either engine's.

        Args:
            prompt_len: Its prompt's length.
            max_tokens: Its own-token budget (the engine's reading of it).
            sampling_params: Its `SamplingParams` (`min_tokens`, `seed`,
                `stop`: the same fields on V0 and V1).

        Returns:
            The parameters.
        """
        return cls(prompt_len, max_tokens, sampling_params.min_tokens,
                   sampling_params.seed, tuple(sampling_params.stop or ()))


@dataclass(frozen=True)
class ChildSpec:
    """A child to fork: everything not named here is its parent's
    sampling parameters, except that it has no prompt logprobs."""

    # Its request id (`child_request_id`).
    request_id: str
    # The promising member's request id.
    parent_id: str
    # Tokens appended to the parent's whole context to make the child's
    # (the role marker, if configured); they are not its own tokens.
    context_tokens: tuple[int, ...]
    # Its own tokens' budget and minimum, counted from its first own token.
    max_tokens: Optional[int]
    min_tokens: int
    # Its seed; None if the request is unseeded.
    seed: Optional[int]
    # Stop strings it honours, as its request does.
    stop: tuple[str, ...]


@dataclass(frozen=True)
class Resume:
    """A parked (or syncing) member's merge: what to append, then go on."""

    # The merged tokens, already cut to leave room for one sampled token.
    token_ids: list[int]
    # The logprob each merged token gets where logprobs are reported.
    token_logprob: float
    # A fresh seed for an engine that re-creates the member's generator
    # when it prefills; None if the request is unseeded.
    seed: Optional[int]


@dataclass(frozen=True)
class MemberResult:
    """What a finished member produced, as its engine has it."""

    # Its own tokens (after its context), merged ones included.
    token_ids: list[int]
    # Its own text as the engine detokenized it (hook token strings may
    # show); None: the coordinator decodes ``token_ids``.
    text: Optional[str]
    # Per own token, its logprobs (merged tokens' entries are replaced by
    # None); None unless the request asked for logprobs.
    logprobs: Optional[list[Optional[TokenLogprobs]]] = None


class EngineAdapter(Protocol):
    """An engine's mechanics, as the coordinator drives them."""

    def new_tree(self, root_id: str) -> LiveTree:
        """A new tree record for ``root_id`` (an engine may subclass
        `LiveTree` to register it)."""
        ...

    def fork(self, child: ChildSpec) -> None:
        """Starts ``child``: its context is its parent's whole context and
        ``child.context_tokens``, sharing the parent's KV cache."""
        ...

    def park(self, member_id: str) -> None:
        """Stops scheduling a member; it keeps its KV cache."""
        ...

    def resume(self, member_id: str, resume: Resume) -> bool:
        """Appends ``resume.token_ids`` to a member (parked or not) and
        schedules it again, computing only the new tokens.

        Returns:
            Whether its random generator was re-created from
            ``resume.seed``.
        """
        ...

    def abort(self, member_ids: list[str]) -> None:
        """Aborts live members (deepest first); no output for them."""
        ...

    def engine_finished(self, member_id: str) -> bool:
        """Whether the engine has finished a member whose finish it has
        not reported yet (it will)."""
        ...

    def encode(self, member_id: str, text: str) -> list[int]:
        """Token ids of text merged into a member; text that spells a
        special token must stay text."""
        ...

    def decode(self, member_id: str, token_ids: list[int]) -> str:
        """The text of a member's own tokens (hook tokens left out)."""
        ...

    def report_tree(self, root_id: str, tree: LiveTree) -> None:
        """A root finished: its tree goes with its final output."""
        ...


class _NoMetrics:
    """Stands in for `SequenceHookMetrics` where nothing is exported."""

    class _Null:

        def inc(self, *_):
            pass

        dec = set = observe = inc

    def __getattr__(self, name: str) -> "_NoMetrics._Null":
        return self._Null()


@dataclass(eq=False)
class _TreeRecord:
    """The coordinator's record of a live tree: the `LiveTree`, its
    request's parameters and its members' ids."""

    state: LiveTree
    params: RequestParams
    member_ids: list[str] = field(default_factory=list)


@dataclass(eq=False)
class _Member:
    """The coordinator's record of one tree member."""

    tree: _TreeRecord
    node: LiveNode
    # Its length when its own tokens began.
    start: int
    # Its seed now (None if unseeded).
    seed: Optional[int]
    # Its length when it was parked.
    parked_length: int = 0


class PromiseCoordinator:
    """Every promise/sync decision of one engine's trees.

    Args:
        special_kwargs: The hook configuration, resolved to ids.
        adapter: The engine's mechanics.
        max_model_len: The engine's longest sequence.
        hook_token_strings: The hook tokens' strings, removed from texts.
        metrics: `SequenceHookMetrics` to update; None: none.
    """

    def __init__(self,
                 special_kwargs: SpecialKwargs,
                 adapter: EngineAdapter,
                 max_model_len: int,
                 hook_token_strings: Sequence[str],
                 metrics=None):
        self.special_kwargs = special_kwargs
        self.adapter = adapter
        self.max_model_len = max_model_len
        self.hook_token_ids = special_kwargs.hook_token_ids
        self.hook_token_strings = list(hook_token_strings)
        self.metrics = metrics if metrics is not None else _NoMetrics()
        # Every member of a live tree, by request id.
        self._members: dict[str, _Member] = {}
        # When each parked member was parked, by request id.
        self._parked: dict[str, float] = {}

    @classmethod
    def for_tokenizer(cls,
                      special_kwargs: SpecialKwargs,
                      adapter: EngineAdapter,
                      max_model_len: int,
                      tokenizer: Any,
                      metrics=None) -> "PromiseCoordinator":
        """The coordinator of an engine whose tokenizer spells the hook
        tokens (a Hugging Face tokenizer: `convert_ids_to_tokens`).

        Args:
            special_kwargs: The hook configuration, resolved to ids.
            adapter: The engine's side of the lifecycle.
            max_model_len: The engine's longest sequence.
            tokenizer: The engine's tokenizer.
            metrics: The hook metrics (`SequenceHookMetrics`), if exported.

        Returns:
            The coordinator.
        """
        return cls(
            special_kwargs, adapter, max_model_len,
            tokenizer.convert_ids_to_tokens(
                sorted(special_kwargs.hook_token_ids)), metrics)

    # Queries.

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

    def is_parked(self, member_id: str) -> bool:
        """Whether ``member_id`` waits at a `<sync>` for its children."""
        member = self._members.get(member_id)
        return member is not None and member.node.parked_since is not None

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
                params: Callable[[], RequestParams]) -> None:
        """A member sampled ``token_id``: `<promise>` and `<sync>` are the
        events `promise` and `sync`, any other token is none.

        Args:
            member_id: The sampling member (any request the first time).
            token_id: The token it sampled last.
            length: Its token count, the token included.
            params: Reads its request's parameters (for a promise only).
        """
        if token_id == self.special_kwargs.promise_token_id:
            self.promise(member_id, length, params())
        elif token_id == self.special_kwargs.sync_token_id:
            self.sync(member_id, length)

    def promise(self, member_id: str, length: int,
                params: RequestParams) -> None:
        """A member sampled `<promise>`: spawns a child unless a limit
        says no (the promise then stays an ordinary token).

        Args:
            member_id: The promising member (a root the first time).
            length: Its token count, the promise included.
            params: Its request's parameters (read for a new root only).
        """
        member = self._members.get(member_id)
        if member is None:
            member = self._track_root(member_id, params)
        tree, node = member.tree.state, member.node
        special_kwargs = self.special_kwargs
        if (len(node.children) >= special_kwargs.max_children_per_sequence
                or tree.num_spawned >= special_kwargs.max_children_per_request
                or node.depth >= special_kwargs.max_depth):
            tree.num_refused += 1
            self.metrics.promises_refused.inc()
            return
        request = member.tree.params
        index = len(node.children)
        marker = special_kwargs.child_role_token_id
        spec = ChildSpec(request_id=child_request_id(tree.root.request_id,
                                                     tree.num_spawned),
                         parent_id=member_id,
                         context_tokens=() if marker is None else (marker, ),
                         max_tokens=request.max_tokens,
                         min_tokens=request.min_tokens,
                         seed=(None if member.seed is None else derive_seed(
                             member.seed, f"child-{index}")),
                         stop=request.stop)
        child = tree.record_child(node, spec.request_id, length - member.start)
        self._members[spec.request_id] = _Member(
            member.tree, child, length + len(spec.context_tokens), spec.seed)
        member.tree.member_ids.append(spec.request_id)
        self.metrics.promises_spawned.inc()
        self.metrics.children_running.inc()
        self.adapter.fork(spec)

    def sync(self, member_id: str, length: int) -> bool:
        """A member sampled `<sync>`: merges its unmerged children if all
        finished, else parks it until they have.

        Args:
            member_id: The syncing member.
            length: Its token count, the sync included.

        Returns:
            Whether it merged or parked; False: `<sync>` was an ordinary
            token (no unmerged child, or not a tree member).
        """
        member = self._members.get(member_id)
        if member is None:
            return False
        node = member.node
        pending = node.unmerged_children()
        if not pending:
            return False
        if all(child.is_finished for child in pending):
            self._merge(member, length)
            return True
        member.parked_length = length
        node.parked_since = self._parked[member_id] = time.monotonic()
        self.metrics.syncs_blocked.inc()
        self.metrics.parents_parked.inc()
        self.adapter.park(member_id)
        return True

    def finished(self, member_id: str, reason: str,
                 result: MemberResult) -> None:
        """A member finished: records its result, aborts its unfinished
        descendants, wakes its parked parent when its siblings are done,
        and reports a root's tree.

        Args:
            member_id: The finished member.
            reason: "stop" or "length".
            result: What it produced.
        """
        member = self._members.get(member_id)
        if member is None or member.node.is_finished:
            return
        tree, node = member.tree.state, member.node
        self._abort_below(node)
        token_ids = list(result.token_ids)
        text = result.text
        if text is None:
            text = self.adapter.decode(
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
            self.adapter.report_tree(member_id, tree)
            return
        self.metrics.children_running.dec()
        parent = node.parent
        if (parent.parked_since is not None and not parent.is_finished
                and all(child.is_finished
                        for child in parent.unmerged_children())):
            parent_member = self._members[parent.request_id]
            self._merge(parent_member, parent_member.parked_length)

    def aborted(self, member_id: str) -> None:
        """The engine aborted a member's request from outside: the whole
        tree ends, with no report.

        Args:
            member_id: A member of the aborted request (the root, or any
                member when the engine resolves a member to its request).
        """
        member = self._members.get(member_id)
        if member is None or member.node.is_finished:
            return
        root = member.tree.state.root
        # Members the engine aborted with the request need nothing more.
        self._abort_below(root)
        self._record_abort(self._members[root.request_id])
        self._forget(member)

    # Transitions.

    def _track_root(self, root_id: str, params: RequestParams) -> _Member:
        """Starts tracking a request's tree at its first promise."""
        state = self.adapter.new_tree(root_id)
        member = _Member(_TreeRecord(state, params, [root_id]), state.root,
                         params.prompt_len, params.seed)
        self._members[root_id] = member
        return member

    def _room(self, member: _Member, length: int) -> int:
        """Tokens a merge may append, leaving one to sample within the
        budget and the model length."""
        room = self.max_model_len - length
        max_tokens = member.tree.params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - (length - member.start))
        return max(room - 1, 0)

    def _merge(self, member: _Member, length: int) -> None:
        """Appends the unmerged children's texts and resumes the member."""
        tree, node = member.tree.state, member.node
        children = tree.take_unmerged(node)
        self._unpark(node)
        text = merged_text(children, self.special_kwargs.merge_separator)
        token_ids = self.adapter.encode(node.request_id,
                                        text)[:self._room(member, length)]
        tree.record_merged_tokens(node, length - member.start, len(token_ids))
        self.metrics.merged_tokens.inc(len(token_ids))
        seed = (None if member.seed is None else derive_seed(
            member.seed, f"resume-{node.num_merged}"))
        if self.adapter.resume(node.request_id,
                               Resume(token_ids, MERGED_TOKEN_LOGPROB, seed)):
            member.seed = seed

    def _abort_below(self, node: LiveNode) -> None:
        """Aborts a node's unfinished descendants, deepest first.

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
        live = [
            target.node.request_id for target in doomed
            if not self.adapter.engine_finished(target.node.request_id)
        ]
        if live:
            self.adapter.abort(live)

    def _record_abort(self, member: _Member) -> None:
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

    def _forget(self, member: _Member) -> None:
        """Drops a finished tree's records (its snapshot lives on)."""
        for member_id in member.tree.member_ids:
            del self._members[member_id]
