# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The promise tree of one request, as the V1 scheduler keeps it."""

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class TreeNode:
    """One sequence of a promise tree (the root is the request itself)."""

    # Engine-internal request id (`<root id>/promise-<n>` for children).
    request_id: str
    # 0 for the root, 1 for its children, and so on.
    depth: int = 0
    # The node whose `<promise>` spawned this one; None for the root.
    parent: Optional["TreeNode"] = field(default=None, repr=False)
    # Spawned nodes, in promise order.
    children: list["TreeNode"] = field(default_factory=list)
    # Tokens of the sequence's context when it started (a child's prompt is
    # its parent's context, the `<promise>` and role marker included); its
    # own tokens come after them.
    fork_len: int = 0
    # Parent tokens already computed at the fork: the child shares their KV.
    num_shared_tokens: int = 0
    # A finished child's own output token ids (after its fork point).
    token_ids: list[int] = field(default_factory=list)
    # A finished child's text, as merged into its parent.
    text: str = ""
    # "stop", "length" or "abort" once finished; None while live.
    finish_reason: Optional[str] = None
    # children[:num_merged] have been merged already.
    num_merged: int = 0
    # Tokens appended to this sequence by its merges.
    num_merged_tokens: int = 0
    # Parked by `<sync>`, waiting for its children.
    parked: bool = False

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def unmerged_children(self) -> list["TreeNode"]:
        """Children promised since the last merge, in promise order."""
        return self.children[self.num_merged:]

    def live_descendants(self) -> list["TreeNode"]:
        """Unfinished nodes below this one, deepest first."""
        found: list[TreeNode] = []
        for child in self.children:
            found += child.live_descendants()
            if not child.is_finished:
                found.append(child)
        return found

    def snapshot(self) -> dict[str, Any]:
        """The user-facing view: plain data, for the request's output."""
        return {
            "request_id": self.request_id,
            "depth": self.depth,
            "text": self.text,
            "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason,
            "num_merged_tokens": self.num_merged_tokens,
            "children": [child.snapshot() for child in self.children],
        }


@dataclass
class PromiseTree:
    """Engine-side state of one request's promise tree."""

    # The request's own sequence.
    root: TreeNode
    # Children spawned over the whole tree.
    num_spawned: int = 0
    # Promises that spawned nothing because a limit was reached.
    num_refused: int = 0
