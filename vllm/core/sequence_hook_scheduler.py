# SPDX-License-Identifier: Apache-2.0
"""A V0 scheduler that can park sequence groups while their children run."""

from typing import Dict, Iterable, List, Optional, Tuple, Union

from vllm.core.scheduler import Scheduler, SchedulerOutputs
from vllm.sequence import (Sequence, SequenceGroup, SequenceGroupBase,
                           SequenceGroupMetadata, SequenceStage,
                           SequenceStatus)


class SequenceHookScheduler(Scheduler):
    """Scheduler with a parking place for blocked sequence groups.

    A group whose sequence sampled `<sync>` while it has unfinished children
    is parked: its sequence is `SequenceStatus.BLOCKED`, it keeps its KV
    blocks, and it is in none of the waiting/running/swapped queues, so it is
    neither scheduled nor preempted until `unblock` puts it back into the
    running queue. Children join the running queue directly, sharing their
    parent's blocks. Selected through `SchedulerConfig.scheduler_cls`.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Parked groups by request id, in the order they were parked.
        self.blocked: Dict[str, SequenceGroup] = {}
        # Sequences whose uncomputed tail the next step prefills.
        self._tails_to_prefill: List[Sequence] = []

    def prefill_tail(self, seq: Sequence) -> None:
        """Has the next step compute ``seq``'s uncomputed tokens as a prefill.

        Tokens appended without being sampled (a merge, a role marker) are
        computed as one prefill chunk on top of the existing KV cache, and a
        prefill also creates a seeded group's generator. The stage changes
        at the next `schedule`, not now: until then the engine still treats
        the group as this step's decode (stats, tracing).
        """
        self._tails_to_prefill.append(seq)

    def schedule(
            self
    ) -> Tuple[List[SequenceGroupMetadata], SchedulerOutputs, bool]:
        for seq in self._tails_to_prefill:
            if not seq.is_finished():
                # Computing the tail moves the stage forward to DECODE again
                # (SequenceData.update_num_computed_tokens).
                seq.data._stage = SequenceStage.PREFILL
        self._tails_to_prefill.clear()
        return super().schedule()

    def add_child(self, parent_seq: Sequence,
                  child_group: SequenceGroup) -> None:
        """Starts a child that shares ``parent_seq``'s KV blocks.

        Args:
            parent_seq: The sequence that promised; its blocks are shared
                copy-on-write with the child.
            child_group: A group holding the child sequence, forked from
                ``parent_seq``.
        """
        self.fork_seq(parent_seq, child_group.first_seq)
        self.running.append(child_group)

    def block(self, seq_group: SequenceGroup) -> None:
        """Parks a running group until `unblock`."""
        self.running.remove(seq_group)
        seq_group.first_seq.status = SequenceStatus.BLOCKED
        self.blocked[seq_group.request_id] = seq_group

    def unblock(self, seq_group: SequenceGroup) -> None:
        """Puts a parked group back into the running queue."""
        del self.blocked[seq_group.request_id]
        seq_group.first_seq.status = SequenceStatus.RUNNING
        self.running.append(seq_group)

    def abort_seq_group(
        self,
        request_id: Union[str, Iterable[str]],
        seq_id_to_seq_group: Optional[Dict[str, SequenceGroupBase]] = None,
    ) -> None:
        """Aborts groups as the stock scheduler does, parked ones included.

        Parked groups being aborted are put back into the running queue
        first, so the stock abort frees them like any other.
        """
        request_ids = {request_id} if isinstance(request_id,
                                                 str) else set(request_id)
        groups = seq_id_to_seq_group or {}
        for parked_id in list(self.blocked):
            real_id = (groups[parked_id].group_id
                       if parked_id in groups else parked_id)
            if real_id in request_ids:
                self.unblock(self.blocked[parked_id])
        super().abort_seq_group(request_ids, seq_id_to_seq_group)

    def has_unfinished_seqs(self) -> bool:
        return super().has_unfinished_seqs() or bool(self.blocked)

    def get_num_unfinished_seq_groups(self) -> int:
        return super().get_num_unfinished_seq_groups() + len(self.blocked)
