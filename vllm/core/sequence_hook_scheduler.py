# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A V0 scheduler that can park sequence groups while their children run."""

from collections import deque
from typing import Dict, Iterable, List, Optional, Protocol, Set, Tuple, Union

from sequence_hooks.ordering import CriticalPathOrder, Queued
from sequence_hooks.special_kwargs import SpecialKwargs
from vllm.core.interfaces import AllocStatus
from vllm.core.scheduler import (ScheduledSequenceGroup, Scheduler,
                                 SchedulerOutputs)
from vllm.sequence import (Sequence, SequenceGroup, SequenceGroupBase,
                           SequenceGroupMetadata, SequenceStage,
                           SequenceStatus)


class SchedulerHooks(Protocol):
    """What the scheduler reports to, and asks of, the engine's hooks
    (`vllm.engine.promise_tree.V0PromiseAdapter`)."""

    special_kwargs: SpecialKwargs

    def step_scheduled(self, outputs: SchedulerOutputs) -> None:
        """What the scheduler handed out (and ignored) this step."""
        ...

    def aborted(self, seq_group: SequenceGroup) -> None:
        """A group of a promise tree that an abort finished."""
        ...

    # The queues' order (`CriticalPathOrder.for_scheduler`); None where
    # upstream's order stands (FCFS, `critical_path_first` off).
    order: Optional[CriticalPathOrder]

    def eviction_order(self, evicted: Set[str],
                       seq_group: SequenceGroup) -> List[str]:
        """Parked groups holding blocks, in the order to evict them for
        ``seq_group`` (`sequence_hooks.ordering.eviction_order`)."""
        ...

    def export_metrics(self, kv_fraction: float) -> None:
        """Exports the hook metrics: the lifecycle's counts, and the
        fraction of KV blocks in use, parked ones included."""
        ...


class SequenceHookScheduler(Scheduler):
    """Scheduler with a parking place for sequence groups waiting at a sync.

    A group whose sequence sampled `<sync>` while it has unfinished children
    is parked: its sequence is `SequenceStatus.BLOCKED`, it keeps its KV
    blocks, and it is in none of the waiting/running/swapped queues, so it is
    not scheduled until `unpark` puts it back. Children join the running
    queue directly, sharing their parent's blocks. When nothing can run
    because parked groups hold the blocks a waiting group needs, parked
    ones are evicted (their blocks freed, to be recomputed when they
    resume; the most recently parked first, the waiting group's ancestors
    last: `sequence_hooks.ordering.eviction_order`), so a full cache never
    deadlocks. With prefix caching
    on they are evicted as soon as blocks run short (see
    `_evict_parked_for_waiting` and `_can_append_slots`): their full blocks
    stay in the prefix cache, so the resume gets them back as hits, as a
    client-side join's continuation request would. Selected through
    `SchedulerConfig.scheduler_cls`.

    Under contention it hands its queues to the ordering policy both
    engines share (`sequence_hooks.ordering.CriticalPathOrder`, see
    `_order_queues`): children of parked parents and resumed parents are
    admitted from the waiting queue before new requests and are the last
    running groups preempted, within a bound on how long a new request may
    be passed over. Under the priority policy, which upstream's
    chunked-prefill scheduling ignores, the policy orders both queues by
    priority then arrival every step, plain requests included.

    It reports to the engine's hooks (`SchedulerHooks`) what it scheduled,
    ignored and aborted, and asks them for the queues' order and which
    parked group to evict; the hooks drive it through `admit_child`,
    `prefill_tail`, `park`, `unpark` and `abort_tree_groups` (which does
    not report back to them), and ask it what the engine processed first
    (`processed_before`).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Parked groups by request id, in the order they were parked.
        self.parked: Dict[str, SequenceGroup] = {}
        # Parked groups whose blocks were freed; they resume by recompute.
        self._evicted: Set[str] = set()
        # Sequences whose uncomputed tail the next step prefills.
        self._tails_to_prefill: List[Sequence] = []
        # The engine's hooks, once attached.
        self.hooks: Optional[SchedulerHooks] = None
        # The groups handed out for this step, in the order the engine
        # processes their outputs.
        self._scheduled: List[ScheduledSequenceGroup] = []

    def attach_hooks(self, hooks: SchedulerHooks) -> None:
        """Sets the hooks this scheduler reports to.

        Args:
            hooks: The engine's one set of hooks.
        """
        self.hooks = hooks

    def admit_child(self, parent_seq: Sequence,
                    child_group: SequenceGroup) -> None:
        """Starts a child that shares ``parent_seq``'s KV blocks.

        A child joins the running queue directly, so it must not push it
        past `max_num_seqs`: past it, the child waits its turn in the
        waiting queue and computes its context then, as a preempted
        sequence does.

        Args:
            parent_seq: The sequence that promised; its blocks are shared
                copy-on-write with the child.
            child_group: A group holding the child sequence, forked from
                ``parent_seq``.
        """
        child_seq = child_group.first_seq
        if len(self.running) >= self.scheduler_config.max_num_seqs:
            child_seq.status = SequenceStatus.WAITING
            child_seq.data.reset_state_for_recompute()
            self.waiting.append(child_group)
            return
        self.fork_seq(parent_seq, child_seq)
        if self.cache_config.enable_prefix_caching:
            # The block manager's fork does not enter the child in the
            # prefix-cache tracker, whose removal (any free) asserts it is
            # there; a scheduled sequence enters it this way.
            self.block_manager.get_num_cached_tokens(child_seq)
        self.running.append(child_group)

    def prefill_tail(self, seq: Sequence) -> None:
        """Has the next step compute ``seq``'s uncomputed tokens as a prefill.

        Tokens appended without being sampled (a merge, a role marker) are
        computed as one prefill chunk on top of the existing KV cache, and a
        prefill also creates a seeded group's generator. The stage changes
        at the next `schedule`, not now: until then the engine still treats
        the group as this step's decode (stats, tracing).
        """
        self._tails_to_prefill.append(seq)

    def park(self, seq_group: SequenceGroup) -> None:
        """Parks a running group until `unpark`.

        A parked group always has an unfinished child in a queue (the last
        child's finish unparks it), so the stock `has_unfinished_seqs` stays
        true while it waits.
        """
        self.running.remove(seq_group)
        seq_group.first_seq.status = SequenceStatus.BLOCKED
        self.parked[seq_group.request_id] = seq_group

    def unpark(self, seq_group: SequenceGroup) -> None:
        """Puts a parked group back: running, or waiting if evicted."""
        del self.parked[seq_group.request_id]
        if seq_group.request_id in self._evicted:
            self._evicted.remove(seq_group.request_id)
            seq_group.first_seq.status = SequenceStatus.WAITING
            # At the front, as upstream puts back preempted groups.
            self.waiting.appendleft(seq_group)
        else:
            seq_group.first_seq.status = SequenceStatus.RUNNING
            self.running.append(seq_group)

    def schedule(
            self
    ) -> Tuple[List[SequenceGroupMetadata], SchedulerOutputs, bool]:
        for seq in self._tails_to_prefill:
            if not seq.is_finished():
                # Computing the tail moves the stage forward to DECODE again
                # (SequenceData.update_num_computed_tokens).
                seq.data._stage = SequenceStage.PREFILL
        self._tails_to_prefill.clear()
        if self.hooks is not None and self.hooks.order is not None:
            self._order_queues()
        self._evict_parked_for_waiting()
        metadata, outputs, allow_async = super().schedule()
        self._scheduled = outputs.scheduled_seq_groups
        if self.hooks is not None:
            self.hooks.step_scheduled(outputs)
        self._report_kv_usage()
        return metadata, outputs, allow_async

    def _order_queues(self) -> None:
        """Hands the waiting and running queues to the policy
        (`sequence_hooks.ordering`), which puts critical-path work first:
        upstream's chunked-prefill scheduling (the only one hooks use)
        schedules the running queue front to back, preempts from its back
        when blocks run out, then admits waiting groups front to back
        until one does not fit. Under the priority policy, which that
        scheduling ignores, the policy sorts both queues every step. The
        swapped queue is not ordered: hooks never swap (no swap space on
        CPU).
        """
        assert self.hooks is not None and self.hooks.order is not None
        order = self.hooks.order
        if not order.begin_step(
                lambda: {
                    seq_group.request_id
                    for queue in (self.waiting, self.running, self.swapped)
                    for seq_group in queue
                }):
            return
        self.running = deque(order.running(self.running, _queued))
        self.waiting = deque(order.waiting(self.waiting, _queued))

    def free_finished_seq_groups(self) -> None:
        super().free_finished_seq_groups()
        self._report_kv_usage()

    def _report_kv_usage(self) -> None:
        if self.hooks is not None:
            total = self.block_manager.num_total_gpu_blocks
            free = self.block_manager.get_num_free_gpu_blocks()
            self.hooks.export_metrics(1.0 - free / total)

    def _evict_parked_for_waiting(self) -> None:
        """Frees parked groups' blocks that the first waiting group needs.

        Without prefix caching only while parked groups alone stop all
        progress (nothing runs or is swapped out): an evicted group
        recomputes its whole context. With it, whenever that group has a
        running slot but not the blocks, since the resume gets the evicted
        full blocks back from the prefix cache unless they were reused.
        """
        # Runs every step: the cheap checks go before `can_allocate`.
        while self.waiting and len(self._evicted) < len(self.parked):
            if self.cache_config.enable_prefix_caching:
                if len(self.running) >= self.scheduler_config.max_num_seqs:
                    return
            elif self.running or self.swapped:
                return
            if (self.block_manager.can_allocate(
                    self.waiting[0]) != AllocStatus.LATER
                    or not self._evict_parked_for(self.waiting[0])):
                return

    def _can_append_slots(self, seq_group: SequenceGroup,
                          enable_chunking: bool) -> bool:
        """Evicts parked groups, with prefix caching on, before upstream
        preempts a running group for lack of a block."""
        while not super()._can_append_slots(seq_group, enable_chunking):
            if not (self.cache_config.enable_prefix_caching
                    and self._evict_parked_for(seq_group)):
                return False
        return True

    def _evict_parked_for(self, seq_group: SequenceGroup) -> bool:
        """Frees the blocks of the parked group the policy gives up first
        for ``seq_group`` (the most recently parked, its own ancestors
        last); it resumes by recompute.

        Returns:
            Whether a group was evicted.
        """
        assert self.hooks is not None
        victims = [
            request_id for request_id in self.hooks.eviction_order(
                self._evicted, seq_group) if request_id in self.parked
        ]
        if not victims:
            return False
        victim = self.parked[victims[0]]
        self.free_seq(victim.first_seq)
        victim.first_seq.data.reset_state_for_recompute()
        self._evicted.add(victim.request_id)
        return True

    def abort_seq_group(
        self,
        request_id: Union[str, Iterable[str]],
        seq_id_to_seq_group: Optional[Dict[str, SequenceGroupBase]] = None,
    ) -> None:
        """Aborts groups as the stock scheduler does, parked ones included,
        and reports the promise trees' groups it finished to the hooks."""
        aborted = self.abort_tree_groups(request_id, seq_id_to_seq_group)
        if self.hooks is not None:
            for seq_group in aborted:
                self.hooks.aborted(seq_group)

    def abort_tree_groups(
        self,
        request_id: Union[str, Iterable[str]],
        seq_id_to_seq_group: Optional[Dict[str, SequenceGroupBase]] = None,
    ) -> List[SequenceGroup]:
        """Aborts groups as the stock scheduler does, parked ones included;
        the hooks' own aborts come here, as they need no report.

        Parked groups being aborted are put back into a queue first, so the
        stock abort frees them like any other.

        Args:
            request_id: The ids to abort.
            seq_id_to_seq_group: The engine's registry, if the ids may be
                registered ones.

        Returns:
            The groups of promise trees that the abort finished.
        """
        request_ids = {request_id} if isinstance(request_id,
                                                 str) else set(request_id)
        groups = seq_id_to_seq_group or {}
        # A registered id (a child's, when the engine aborts it because its
        # input failed) stands for its whole request, whose id the stock
        # abort matches.
        request_ids |= {groups[r].group_id for r in request_ids if r in groups}
        for parked_id in list(self.parked):
            real_id = (groups[parked_id].group_id
                       if parked_id in groups else parked_id)
            if real_id in request_ids:
                self.unpark(self.parked[parked_id])
        tree_groups = [
            seq_group for queue in (self.waiting, self.running, self.swapped)
            for seq_group in queue
            if seq_group.first_seq.promise_tree is not None
        ]
        super().abort_seq_group(request_ids, seq_id_to_seq_group)
        self._report_kv_usage()
        return [
            seq_group for seq_group in tree_groups
            if seq_group.first_seq.status == SequenceStatus.FINISHED_ABORTED
        ]

    def processed_before(self, seq_group: SequenceGroup,
                         current: Optional[SequenceGroup]) -> bool:
        """Whether the engine processed ``seq_group``'s output of this step
        before ``current``'s, which it is processing now.

        Args:
            seq_group: An unfinished group.
            current: The group being processed; None: none is yet (the
                ignored groups' finishes come first).

        Returns:
            True if the engine makes ``seq_group`` an output this step.
        """
        if current is None:
            return False
        for scheduled in self._scheduled:
            if scheduled.seq_group is current:
                return False
            if scheduled.seq_group is seq_group:
                return True
        return False

    def get_num_unfinished_seq_groups(self) -> int:
        return super().get_num_unfinished_seq_groups() + len(self.parked)


def _queued(seq_group: SequenceGroup) -> Queued:
    """What the ordering policy reads of a group: a child's priority and
    arrival time are its root's (`V0PromiseAdapter.fork`)."""
    return Queued(seq_group.request_id, seq_group.priority,
                  seq_group.arrival_time)
