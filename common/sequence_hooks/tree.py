# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The promise tree of one request: engine-side record and user snapshot.

Two kinds of tree, two names: a live tree (`LiveTree` of `LiveNode`s),
which changes while the request runs, and its snapshot (`PromiseNode`s),
what users get.

Engine-neutral: it imports no vLLM module. Only the lifecycle
(`sequence_hooks.lifecycle.Coordinator`) changes a tree, whichever
engine runs it: its structure and results through `LiveTree`'s
methods, its own bookkeeping (`LiveNode.parked_since`,
`LiveTree.num_refused`) by assignment. Users get `PromiseNode`
snapshots, which never change once made.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

# Per output token, the logprobs of the sampled token and the top ones
# (vLLM's `Logprob` objects), as in `CompletionOutput.logprobs`.
TokenLogprobs = Mapping[int, Any]


@dataclass(frozen=True)
class PromiseNode:
    """One sequence of a promise tree, as `RequestOutput.promise_tree` shows
    it: an immutable snapshot.

    The root stands for the request's own sequence; every other node is a
    child spawned by its parent's `<promise>`, in promise order. A node's
    results (tokens, text, logprobs) are recorded when it finishes. A
    node's context is its parent's context, the parent's first
    `fork_position` tokens and the role marker, if configured; the root's
    is the prompt.
    """

    # Engine-internal request id of the sequence (the root's is the
    # request's own id; a child's is `<root id>/promise-<k>`,
    # `sequence_hooks.lifecycle.child_request_id`).
    request_id: str
    # Nesting depth: 0 for the root, 1 for its children, and so on.
    depth: int
    # Children in the order their promises were made.
    children: tuple["PromiseNode", ...]
    # The sequence's own output text, hook tokens removed (a child's is
    # what was merged into its parent); "" until it finishes.
    text: str
    # The sequence's own output token ids (a child's after its fork point;
    # merged tokens included); () until it finishes.
    token_ids: tuple[int, ...]
    # "stop", "length" or "abort" once finished; None while running.
    finish_reason: Optional[str]
    # Tokens appended to this sequence by its merges.
    num_merged_tokens: int
    # Where merges appended tokens: (start, count) in `token_ids`. Those
    # tokens were given, not sampled.
    merged_spans: tuple[tuple[int, int], ...] = ()
    # How many of its parent's own tokens its context holds (up to and
    # including the `<promise>` that spawned it); None for the root.
    fork_position: Optional[int] = None
    # Per token of `token_ids`, its logprobs as `CompletionOutput.logprobs`
    # gives them, None for a merged token; None unless the request asked
    # for logprobs.
    logprobs: Optional[tuple[Optional[TokenLogprobs], ...]] = None
    # Sum of the sampled tokens' logprobs; None unless logprobs were asked.
    cumulative_logprob: Optional[float] = None
    # The node whose `<promise>` spawned this one; None for the root.
    parent: Optional["PromiseNode"] = field(default=None,
                                            compare=False,
                                            repr=False)
    # Its label, where a format names its branches (ThreadWeaver's
    # outline labels); None otherwise.
    label: Optional[str] = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def sampled_mask(self) -> tuple[bool, ...]:
        """Per token of `token_ids`, whether it was sampled (not merged)."""
        mask = [True] * len(self.token_ids)
        for start, count in self.merged_spans:
            mask[start:start + count] = [False] * count
        return tuple(mask)

    @property
    def critical_path(self) -> int:
        """Decoding steps on the subtree's longest chain of dependencies.

        One step per sampled token; a child starts in the step after its
        parent sampled its `<promise>`; a merge takes one step (the
        resume's prefill) once every child it merges (those spawned
        before it and not merged yet) has finished. The sequential form of
        the same work takes as many steps as it has tokens.
        """
        merges = dict(self.merged_spans)
        waiting: list[tuple[int, int]] = []  # (fork position, end step)
        children = iter(self.children)
        child = next(children, None)
        step = position = 0
        while position < len(self.token_ids):
            if position in merges:
                ends = [end for fork, end in waiting if fork <= position]
                waiting = [(f, e) for f, e in waiting if f > position]
                step = max([step, *ends]) + 1
                position += merges[position]
                continue
            step += 1
            position += 1
            while child is not None and child.fork_position == position:
                waiting.append((position, step + child.critical_path))
                child = next(children, None)
        return step

    def to_dict(self, top_logprobs: bool = False) -> dict:
        """The subtree as JSON-ready data.

        Args:
            top_logprobs: Whether a token's logprobs are all its entries,
                as `[token id, logprob, rank]` lists (the sampled token's
                first), rather than the sampled token's logprob alone.
                Either is null for a merged token.

        Returns:
            The node's fields and, under "children", its children's.
        """
        logprobs = None
        if self.logprobs is not None:
            logprobs = [
                None if entry is None else
                [[token_id, logprob.logprob, logprob.rank]
                 for token_id, logprob in entry.items()]
                if top_logprobs else entry[token].logprob
                for token, entry in zip(self.token_ids, self.logprobs)
            ]
        return {
            "request_id": self.request_id,
            "depth": self.depth,
            "fork_position": self.fork_position,
            "text": self.text,
            "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason,
            "num_merged_tokens": self.num_merged_tokens,
            "merged_spans": [list(span) for span in self.merged_spans],
            "logprobs": logprobs,
            "cumulative_logprob": self.cumulative_logprob,
            "label": self.label,
            "children":
            [child.to_dict(top_logprobs) for child in self.children],
        }

    @classmethod
    def from_dict(cls,
                  data: Mapping[str, Any],
                  make_logprob: Callable[[float, Optional[int]], Any],
                  parent: Optional["PromiseNode"] = None) -> "PromiseNode":
        """The snapshot `to_dict` gave, rebuilt (e.g. in another process).

        Args:
            data: What `to_dict` returned, in either logprobs form.
            make_logprob: Makes a logprob entry (vLLM's `Logprob`) from a
                logprob and its rank (None if not sent).
            parent: The rebuilt parent node; None for the root.

        Returns:
            The node and its subtree.
        """
        logprobs = data["logprobs"]
        if logprobs is not None:
            logprobs = tuple(
                _logprob_entry(token, entry, make_logprob)
                for token, entry in zip(data["token_ids"], logprobs))
        node = cls(data["request_id"], data["depth"], (), data["text"],
                   tuple(data["token_ids"]), data["finish_reason"],
                   data["num_merged_tokens"],
                   tuple(tuple(span) for span in data["merged_spans"]),
                   data["fork_position"], logprobs, data["cumulative_logprob"],
                   parent, data.get("label"))
        # As in `LiveNode.snapshot`: children point back at the node.
        object.__setattr__(
            node, "children",
            tuple(
                cls.from_dict(child, make_logprob, node)
                for child in data["children"]))
        return node


def _logprob_entry(token: int, entry: Any,
                   make_logprob: Callable) -> Optional[TokenLogprobs]:
    """One token's logprobs from either form `PromiseNode.to_dict` gives:
    null (merged), `[[id, logprob, rank], ...]` or the sampled token's
    logprob."""
    if entry is None:
        return None
    if isinstance(entry, list):
        return {
            token_id: make_logprob(logprob, rank)
            for token_id, logprob, rank in entry
        }
    return {token: make_logprob(entry, None)}


@dataclass(eq=False)
class LiveNode:
    """One sequence of a live promise tree: the engine-side record, which
    changes as the sequence runs (`PromiseNode` is its snapshot)."""

    # Engine-internal request id of the sequence.
    request_id: str
    # Nesting depth: 0 for the root.
    depth: int = 0
    # The node whose `<promise>` spawned this one; None for the root.
    parent: Optional["LiveNode"] = field(default=None, repr=False)
    # Children in promise order.
    children: list["LiveNode"] = field(default_factory=list)
    # Its parent's own tokens in its context (see `PromiseNode`).
    fork_position: Optional[int] = None
    # The child's own output text, as merged into its parent.
    text: str = ""
    # The child's own output token ids (after its fork point).
    token_ids: list[int] = field(default_factory=list)
    # "stop", "length" or "abort" once finished; None while running.
    finish_reason: Optional[str] = None
    # Children[:num_merged] have been merged into this sequence already.
    num_merged: int = 0
    # Tokens appended to this sequence by its merges.
    num_merged_tokens: int = 0
    # (start, count) of each merge in its own tokens.
    merged_spans: list[tuple[int, int]] = field(default_factory=list)
    # Per own token, its logprobs (None if merged); None if not asked.
    logprobs: Optional[list[Optional[TokenLogprobs]]] = None
    # Sum of its sampled tokens' logprobs; None if not asked.
    cumulative_logprob: Optional[float] = None
    # When it was last parked by <sync> (time.monotonic()); None while not
    # parked.
    parked_since: Optional[float] = field(default=None, repr=False)
    # Its label, where a format names its branches; None otherwise.
    label: Optional[str] = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def unmerged_children(self) -> list["LiveNode"]:
        """Children promised since the last merge, in promise order."""
        return self.children[self.num_merged:]

    def live_descendants(self) -> list["LiveNode"]:
        """Unfinished nodes below this one, deepest first."""
        found: list[LiveNode] = []
        for child in self.children:
            found += child.live_descendants()
            if not child.is_finished:
                found.append(child)
        return found

    def subtree(self) -> list["LiveNode"]:
        """This node and every node below it, parents first."""
        nodes = [self]
        for child in self.children:
            nodes += child.subtree()
        return nodes

    def snapshot(self, parent: Optional[PromiseNode] = None) -> PromiseNode:
        """An immutable copy of this node and its subtree."""
        node = PromiseNode(
            self.request_id, self.depth, (), self.text,
            tuple(self.token_ids), self.finish_reason, self.num_merged_tokens,
            tuple(self.merged_spans), self.fork_position,
            None if self.logprobs is None else tuple(self.logprobs),
            self.cumulative_logprob, parent, self.label)
        # The children point back at the node: set them once it exists
        # (the dataclass is frozen to users, not to its builder).
        object.__setattr__(
            node, "children",
            tuple(child.snapshot(node) for child in self.children))
        return node


@dataclass(kw_only=True)
class LiveTree:
    """One request's live promise tree: its `LiveNode`s and counts, the
    engine-side record while the request runs.

    Every change goes through a method here, which also invalidates the
    cached snapshot, so `snapshot` is rebuilt only when the tree changed.
    """

    # The request's own sequence.
    root: LiveNode = field(default_factory=lambda: LiveNode(""))
    # Every node of the tree, by request id.
    nodes: dict[str, LiveNode] = field(default_factory=dict)
    # Children spawned over the whole tree.
    num_spawned: int = 0
    # Promises that spawned nothing because a limit was reached.
    num_refused: int = 0
    # The last snapshot made, while still current.
    _snapshot: Optional[PromiseNode] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.nodes[self.root.request_id] = self.root

    def record_child(self,
                     node: LiveNode,
                     request_id: str,
                     fork_position: int,
                     label: Optional[str] = None) -> LiveNode:
        """Records a child spawned by ``node``.

        Args:
            node: The promising sequence's node.
            request_id: The child's request id.
            fork_position: ``node``'s own tokens in the child's context.
            label: Its label, where a format names branches.

        Returns:
            The child's node.
        """
        child = LiveNode(request_id,
                         depth=node.depth + 1,
                         parent=node,
                         fork_position=fork_position,
                         label=label)
        node.children.append(child)
        self.nodes[request_id] = child
        self.num_spawned += 1
        self._snapshot = None
        return child

    def record_finish(self,
                      node: LiveNode,
                      finish_reason: str,
                      token_ids: list[int],
                      text: str,
                      logprobs: Optional[list[Optional[TokenLogprobs]]] = None,
                      cumulative_logprob: Optional[float] = None) -> None:
        """Records a finished sequence's result (its own part).

        Args:
            node: Its node.
            finish_reason: "stop" or "length".
            token_ids: Its own output tokens.
            text: Its own output text, hook tokens removed.
            logprobs: Per own token, its logprobs (None where merged), if
                the request asked for logprobs.
            cumulative_logprob: Sum of its sampled tokens' logprobs, if
                asked.
        """
        node.finish_reason = finish_reason
        node.token_ids = token_ids
        # A stop string inside merged text (V1's frontend checks it there)
        # ends the tokens within their last merge: the spans end with them.
        node.merged_spans = [(start, min(count,
                                         len(token_ids) - start))
                             for start, count in node.merged_spans
                             if start < len(token_ids)]
        node.num_merged_tokens = sum(count for _, count in node.merged_spans)
        node.text = text
        node.logprobs = logprobs
        node.cumulative_logprob = cumulative_logprob
        self._snapshot = None

    def record_abort(self, node: LiveNode) -> None:
        """Records an aborted sequence."""
        node.finish_reason = "abort"
        self._snapshot = None

    def take_unmerged(self, node: LiveNode) -> list[LiveNode]:
        """Marks ``node``'s unmerged children merged and returns them."""
        children = node.unmerged_children()
        node.num_merged = len(node.children)
        return children

    def record_merged_tokens(self, node: LiveNode, start: int,
                             num_tokens: int) -> None:
        """Records tokens a merge appended to ``node``'s sequence.

        Args:
            node: The merging sequence's node.
            start: Where they start in its own tokens.
            num_tokens: How many.
        """
        node.num_merged_tokens += num_tokens
        if num_tokens:
            node.merged_spans.append((start, num_tokens))
        self._snapshot = None

    def snapshot(self) -> PromiseNode:
        """The tree as users see it now; the same object until it changes."""
        if self._snapshot is None:
            self._snapshot = self.root.snapshot()
        return self._snapshot
