# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a coordinator (`sequence_hooks.lifecycle`) records of the trees it
runs: each tree's record and each member's."""

from dataclasses import dataclass, field
from typing import Optional

from sequence_hooks.actions import RequestParams
from sequence_hooks.tree import LiveNode, LiveTree


@dataclass(eq=False)
class TreeRecord:
    """The coordinator's record of a live tree: the `LiveTree`, its
    request's parameters and its members' ids."""

    state: LiveTree
    params: RequestParams
    member_ids: list[str] = field(default_factory=list)


@dataclass(eq=False)
class Member:
    """The coordinator's record of one tree member."""

    tree: TreeRecord
    node: LiveNode
    # Its length when its own tokens began.
    start: int
    # Its seed now (None if unseeded).
    seed: Optional[int]
    # Its length when it was parked.
    parked_length: int = 0
