# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the lifecycle counts of its trees (`HookCounts`): plain numbers
the coordinator keeps, which an engine's adapter exports as metrics
(`sequence_hooks.metrics`) or a test reads."""

from dataclasses import dataclass, field


@dataclass
class HookCounts:
    """The counts of one coordinator's trees, from its start."""

    promises_spawned: int = 0
    """Children spawned."""
    promises_refused: int = 0
    """Promises a limit refused."""
    syncs_blocked: int = 0
    """Members parked until their children finished."""
    merged_tokens: int = 0
    """Tokens appended to members by joins."""
    parents_parked: int = 0
    """Members parked now."""
    children_running: int = 0
    """Children alive now (running, waiting or parked)."""
    blocked_times: list[float] = field(default_factory=list)
    """How long each member was parked (seconds of the coordinator's
    clock), observed when it resumed or was aborted, not yet exported."""

    def take_blocked_times(self) -> list[float]:
        """The parked times observed since the last call (an exporter's
        histogram observes each once).

        Returns:
            The times, oldest first.
        """
        taken, self.blocked_times = self.blocked_times, []
        return taken
