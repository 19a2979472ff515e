# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The promise tree of one request: engine-side record and user snapshot.

Engine-neutral: it imports no vLLM module, so the V0 fork and the V1 plugin
keep their trees the same way. An engine's coordinator changes a tree only
through `PromiseTreeState`'s methods; users get `PromiseNode` snapshots,
which never change once made.
"""

import hashlib
from dataclasses import dataclass, field
from typing import Optional

from sequence_hooks.special_kwargs import SpecialKwargs


@dataclass(frozen=True)
class PromiseNode:
    """One sequence of a promise tree, as `RequestOutput.promise_tree` shows
    it: an immutable snapshot.

    The root stands for the request's own sequence; every other node is a
    child spawned by its parent's `<promise>`, in promise order.
    """

    # Engine-internal request id of the sequence (the root's is the
    # request's own id; a child's is `<request id>/promise-<n>`).
    request_id: str
    # Nesting depth: 0 for the root, 1 for its children, and so on.
    depth: int
    # Children in the order their promises were made.
    children: tuple["PromiseNode", ...]
    # A child's own output text, as merged into its parent ("" while it
    # runs, and for the root).
    text: str
    # A child's own output token ids, after its fork point.
    token_ids: tuple[int, ...]
    # "stop", "length" or "abort" once finished; None while running.
    finish_reason: Optional[str]
    # Tokens appended to this sequence by its merges.
    num_merged_tokens: int
    # The node whose `<promise>` spawned this one; None for the root.
    parent: Optional["PromiseNode"] = field(default=None,
                                            compare=False,
                                            repr=False)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class TreeNode:
    """Engine-side record of one sequence of a promise tree."""

    # Engine-internal request id of the sequence.
    request_id: str
    # Nesting depth: 0 for the root.
    depth: int = 0
    # The node whose `<promise>` spawned this one; None for the root.
    parent: Optional["TreeNode"] = field(default=None, repr=False)
    # Children in promise order.
    children: list["TreeNode"] = field(default_factory=list)
    # Output tokens the sequence had when it was spawned (its context's part
    # beyond the prompt); its own tokens come after them.
    fork_output_len: int = 0
    # Length of the output text it had when it was spawned.
    fork_text_len: int = 0
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
    # When it was last parked by <sync> (time.monotonic()); None while not
    # parked.
    blocked_since: Optional[float] = field(default=None, repr=False)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def unmerged_children(self) -> list["TreeNode"]:
        """Children promised since the last merge, in promise order."""
        return self.children[self.num_merged:]

    def snapshot(self, parent: Optional[PromiseNode] = None) -> PromiseNode:
        """An immutable copy of this node and its subtree."""
        node = PromiseNode(self.request_id, self.depth, (), self.text,
                           tuple(self.token_ids), self.finish_reason,
                           self.num_merged_tokens, parent)
        # The children point back at the node: set them once it exists
        # (the dataclass is frozen to users, not to its builder).
        object.__setattr__(
            node, "children",
            tuple(child.snapshot(node) for child in self.children))
        return node


@dataclass(kw_only=True)
class PromiseTreeState:
    """Engine-side record of one request's promise tree.

    Every change goes through a method here, which also invalidates the
    cached snapshot, so `snapshot` is rebuilt only when the tree changed.
    """

    # The request's own sequence.
    root: TreeNode = field(default_factory=lambda: TreeNode(""))
    # Every node of the tree, by request id.
    nodes: dict[str, TreeNode] = field(default_factory=dict)
    # Children spawned over the whole tree.
    num_spawned: int = 0
    # Promises that spawned nothing because a limit was reached.
    num_refused: int = 0
    # The last snapshot made, while still current.
    _snapshot: Optional[PromiseNode] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.nodes[self.root.request_id] = self.root

    def may_spawn(self, node: TreeNode, limits: SpecialKwargs) -> bool:
        """Whether ``node`` may spawn one more child; counts a refusal."""
        if (len(node.children) >= limits.max_children_per_sequence
                or self.num_spawned >= limits.max_children_per_request
                or node.depth >= limits.max_depth):
            self.num_refused += 1
            return False
        return True

    def add_child(self, node: TreeNode, request_id: str, fork_output_len: int,
                  fork_text_len: int) -> TreeNode:
        """Records a child spawned by ``node``.

        Args:
            node: The promising sequence's node.
            request_id: The child's request id.
            fork_output_len: Output tokens of the child's context.
            fork_text_len: Output text length of the child's context.

        Returns:
            The child's node.
        """
        child = TreeNode(request_id,
                         depth=node.depth + 1,
                         parent=node,
                         fork_output_len=fork_output_len,
                         fork_text_len=fork_text_len)
        node.children.append(child)
        self.nodes[request_id] = child
        self.num_spawned += 1
        self._snapshot = None
        return child

    def record_finish(self, node: TreeNode, finish_reason: str,
                      token_ids: list[int], text: str) -> None:
        """Records a finished sequence's result (a child's own part)."""
        node.finish_reason = finish_reason
        node.token_ids = token_ids
        node.text = text
        self._snapshot = None

    def record_abort(self, node: TreeNode) -> None:
        """Records an aborted sequence."""
        node.finish_reason = "abort"
        self._snapshot = None

    def take_unmerged(self, node: TreeNode) -> list[TreeNode]:
        """Marks ``node``'s unmerged children merged and returns them."""
        children = node.unmerged_children()
        node.num_merged = len(node.children)
        return children

    def record_merged_tokens(self, node: TreeNode, num_tokens: int) -> None:
        """Records tokens a merge appended to ``node``'s sequence."""
        node.num_merged_tokens += num_tokens
        self._snapshot = None

    def snapshot(self) -> PromiseNode:
        """The tree as users see it now; the same object until it changes."""
        if self._snapshot is None:
            self._snapshot = self.root.snapshot()
        return self._snapshot


def merged_text(children: list[TreeNode], separator: str) -> str:
    """The text a merge appends: the children's texts in promise order."""
    return separator.join(child.text for child in children)


def without_hook_tokens(text: str, hook_token_strings: list[str]) -> str:
    """``text`` with every hook token's string removed.

    Hook tokens show in a detokenized text when they are not special tokens
    of the tokenizer, or special tokens are not skipped.
    """
    for token in hook_token_strings:
        text = text.replace(token, "")
    return text


def derive_seed(seed: int, purpose: str) -> int:
    """A deterministic seed for a child or a resume of a seeded sequence.

    A prefill re-creates a seeded sequence's generator from its seed, so each
    child and each resume gets its own seed, derived from its parent's.

    Args:
        seed: The parent's seed.
        purpose: What the seed is for, e.g. "child-0" or "resume-1".

    Returns:
        A non-negative 63-bit seed.
    """
    digest = hashlib.blake2b(f"{seed}:{purpose}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1
