# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the lifecycle counts of its trees (`HookCounts`): plain numbers
the coordinator keeps, which an engine's adapter exports as metrics
(`sequence_hooks.metrics`) or a test reads."""

from dataclasses import dataclass, field


@dataclass
class HookCounts:
    """The counts of one coordinator's trees, from its start."""

    # Children spawned, and promises or branches a limit refused.
    promises_spawned: int = 0
    promises_refused: int = 0
    # Members parked until their children finished.
    syncs_blocked: int = 0
    # Tokens appended to members by joins.
    merged_tokens: int = 0
    # Members parked now, and children alive now (running, waiting or
    # parked).
    parents_parked: int = 0
    children_running: int = 0
    # How long each member was parked (seconds of the coordinator's
    # clock), observed when it resumed or was aborted, not yet exported.
    blocked_times: list[float] = field(default_factory=list)

    def take_blocked_times(self) -> list[float]:
        """The parked times observed since the last call (an exporter's
        histogram observes each once).

        Returns:
            The times, oldest first.
        """
        taken, self.blocked_times = self.blocked_times, []
        return taken
