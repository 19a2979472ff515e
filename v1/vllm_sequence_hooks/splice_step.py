# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the scheduler tells the model runners of a step for the joins that
splice KV (`splicing` writes it, `splice_runner` reads it): position maps
and token copies. Plain data: it is pickled with the `SchedulerOutput` to
every worker process.
"""

from dataclasses import dataclass, field

import numpy as np

# The `SchedulerOutput` attribute that carries a step's `SpliceStep`.
STEP_ATTRIBUTE = "sequence_hooks_splice"
# A position map: ``(first index, delta)`` pieces, sorted; an index's
# position is the index plus the delta of the last piece at or before it.
PositionMap = tuple[tuple[int, int], ...]


@dataclass
class SpliceStep:
    """What the scheduler tells the model runners for one step."""

    # Per request whose map is new or changed, its map.
    position_maps: dict[str, PositionMap] = field(default_factory=dict)
    # Fresh blocks that copies fill in part: zeroed first.
    zero_blocks: list[int] = field(default_factory=list)
    # Token copies, ``(source block, offset, destination block, offset)``
    # in the scheduler's blocks, in order.
    token_copies: list[tuple[int, int, int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.position_maps or self.zero_blocks
                    or self.token_copies)


def deltas(position_map: PositionMap, indices: np.ndarray) -> np.ndarray:
    """Each index's position minus the index, by ``position_map``.

    Args:
        position_map: The map's pieces.
        indices: Token indices.

    Returns:
        Their deltas (0 before the first piece).
    """
    starts = np.fromiter((start for start, _ in position_map), np.int64)
    values = np.fromiter((delta for _, delta in position_map), np.int64)
    piece = np.searchsorted(starts, indices, side="right") - 1
    return np.where(piece >= 0, values[np.maximum(piece, 0)], 0)
