# SPDX-License-Identifier: Apache-2.0
"""The tree of child sequences a request spawns through `<promise>`."""

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from vllm.sequence import SequenceGroup, SequenceGroupBase


@dataclass
class PromiseNode:
    """One sequence of a promise tree, as `RequestOutput.promise_tree` shows it.

    The root stands for the request's own sequence; every other node is a
    child spawned by its parent's `<promise>`, in promise order.
    """

    # Engine-internal request id of the sequence group (the root's is the
    # request's own id).
    request_id: str
    # Nesting depth: 0 for the root, 1 for its children, and so on.
    depth: int = 0
    # The node whose `<promise>` spawned this one; None for the root.
    parent: Optional["PromiseNode"] = field(default=None, repr=False)
    # Children in the order their promises were made.
    children: List["PromiseNode"] = field(default_factory=list)
    # Output tokens the sequence had when it was spawned (its context's part
    # beyond the prompt); its own tokens come after them.
    fork_output_len: int = 0
    # Length of the output text it had when it was spawned.
    fork_text_len: int = 0
    # The child's own output text, as merged into its parent.
    text: str = ""
    # The child's own output token ids (after its fork point).
    token_ids: List[int] = field(default_factory=list)
    # "stop", "length" or "abort" once finished; None while running.
    finish_reason: Optional[str] = None
    # Children[:num_merged] have been merged into this sequence already.
    num_merged: int = 0
    # Tokens appended to this sequence by its merges.
    num_merged_tokens: int = 0
    # When it was last parked by <sync> (time.monotonic()).
    blocked_since: float = field(default=0.0, repr=False)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def unmerged_children(self) -> List["PromiseNode"]:
        """Children promised since the last merge, in promise order."""
        return self.children[self.num_merged:]


@dataclass
class PromiseTree(SequenceGroupBase):
    """Engine-side state of one request's promise tree.

    Registered in `LLMEngine.seq_id_to_seq_group` under each child's request
    id with `group_id` set to the request's id, which is vLLM's own mechanism
    (as for parallel sampling) to make aborting the request abort its
    children and to keep children from producing outputs of their own. It
    lives as long as its request's sequence groups refer to it.
    """

    # The engine's `seq_id_to_seq_group`, which holds the children's entries.
    registry: Dict[str, SequenceGroupBase] = field(default_factory=dict,
                                                   repr=False)
    # The request's own sequence.
    root: PromiseNode = field(default_factory=lambda: PromiseNode(""))
    # Every node of the tree, by request id.
    nodes: Dict[str, PromiseNode] = field(default_factory=dict)
    # Live (unfinished) sequence groups of the tree, by request id.
    seq_groups: Dict[str, SequenceGroup] = field(default_factory=dict)
    # Children spawned over the whole tree.
    num_spawned: int = 0
    # Promises that spawned nothing because a limit was reached.
    num_refused: int = 0

    def __post_init__(self) -> None:
        self.nodes[self.root.request_id] = self.root

    def maybe_assemble_group(
            self, seq_group: SequenceGroup) -> Optional[SequenceGroup]:
        # Children report through their parent's output only.
        return None

    def finish_seq(self, seq_group: SequenceGroup) -> None:
        # Called once the finished child's (absent) output was made: its
        # entry is not needed any more. The output processor records the
        # child's result.
        self.registry.pop(seq_group.request_id, None)
        # Tracing reads it; from_seq_group sets it only for groups that
        # produce an output.
        seq_group.set_finished_time(time.time())
