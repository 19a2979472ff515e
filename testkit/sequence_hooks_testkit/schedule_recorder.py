# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Records what a V0 scheduler hands out at every step."""

from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass(frozen=True)
class ScheduledChunk:
    """One group's part of a step, as the scheduler handed it out."""
    # The group's request id.
    request_id: str
    # Tokens computed for it this step.
    num_tokens: int
    # Whether it ran as a prefill (chunk).
    is_prompt: bool
    # Tokens its sequence had computed before this step.
    num_computed_before: int
    # Tokens of its prefill the prefix cache held, which the model runner
    # skips (counted in `num_tokens`).
    num_cached_tokens: int = 0


@dataclass
class ScheduledStep:
    """What one step scheduled, and who was parked meanwhile."""
    # The scheduled groups, in the order the engine processes them.
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Request ids of groups parked by `<sync>` when the step was scheduled
    # (for the whole step, even if its output processing wakes them).
    parked: list[str] = field(default_factory=list)


class ScheduleRecorder:
    """Wraps a scheduler's `schedule` while in a `with` block.

    Args:
        scheduler: The engine's (hook) scheduler.
        observe: Also called with the scheduler's outputs after each
            `schedule`, for callers that need more than the chunks.
    """

    def __init__(self, scheduler, observe: Optional[Callable] = None):
        self.scheduler = scheduler
        self.observe = observe
        # Every step scheduled inside the block, in order.
        self.steps: list[ScheduledStep] = []
        self._schedule = None

    def start(self) -> "ScheduleRecorder":
        """Starts recording (for a whole run: no `with` block needed)."""
        self._schedule = self.scheduler.schedule
        self.scheduler.schedule = self._recording_schedule
        return self

    def stop(self) -> None:
        """Gives the scheduler its own `schedule` back."""
        self.scheduler.schedule = self._schedule

    def __enter__(self) -> "ScheduleRecorder":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _recording_schedule(self):
        metadata, outputs, allow_async = self._schedule()
        step = ScheduledStep(
            parked=list(getattr(self.scheduler, "parked", {})))
        block_size = self.scheduler.cache_config.block_size
        for m, scheduled in zip(metadata, outputs.scheduled_seq_groups):
            seq = scheduled.seq_group.first_seq
            step.chunks.append(
                ScheduledChunk(m.request_id, scheduled.token_chunk_size,
                               m.is_prompt, seq.data.get_num_computed_tokens(),
                               len(m.computed_block_nums or []) * block_size))
        self.steps.append(step)
        if self.observe is not None:
            self.observe(outputs)
        return metadata, outputs, allow_async

    def chunks_of(self, request_id: str) -> list[tuple[int, bool]]:
        """(tokens, is prefill) of every step ``request_id`` ran in."""
        return [(chunk.num_tokens, chunk.is_prompt) for step in self.steps
                for chunk in step.chunks if chunk.request_id == request_id]
