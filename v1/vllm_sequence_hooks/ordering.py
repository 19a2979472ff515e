# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`critical_path_first` on V1: the work a parked tree waits for goes
first in the scheduler's queues, as on V0.

V1's scheduler (FCFS policy) schedules its running list front to back,
preempts from its back when blocks run out, then admits the KV-holding
waiting queue and the waiting queue front to back until a request does
not fit. Ordering the three by rank before each step therefore admits
critical-path work (a child whose parent is parked, a member resumed
after a merge) before new requests and preempts it last. A new request
passed over for such work is counted; after `max_steps_passed_over`
steps it is overdue and ranks with critical-path work by arrival time,
so only trees of requests that arrived before it still go first.

With the priority policy the waiting queues are heaps ordered by the
user's priorities: only the running list is ordered (critical-path work
preempted last); admission stays upstream's.
"""

from collections import deque
from collections.abc import Iterable

from sequence_hooks.lifecycle import PromiseCoordinator
from vllm.v1.request import Request

CRITICAL, OVERDUE, NEW = 0, 1, 2


class CriticalPathOrder:
    """Orders a V1 scheduler's queues critical-path first.

    Args:
        coordinator: The lifecycle, which knows what is on a critical path.
        bound: Steps a new request may be passed over
            (`max_steps_passed_over`).
    """

    def __init__(self, coordinator: PromiseCoordinator, bound: int) -> None:
        self.coordinator = coordinator
        self.bound = bound
        # New requests passed over by critical-path work, by request id:
        # steps so far.
        self.steps_passed_over: dict[str, int] = {}

    def order(self, scheduler) -> None:
        """Orders ``scheduler``'s running list and, with the FCFS policy,
        its waiting queues, before a step is scheduled.

        Args:
            scheduler: The V1 scheduler (`SequenceHookScheduler`).
        """
        if not (self.coordinator.num_members() or self.steps_passed_over):
            # No tree, no debt: the stock order.
            return
        self.steps_passed_over = {
            request_id: steps
            for request_id, steps in self.steps_passed_over.items()
            if request_id in scheduler.requests
        }
        scheduler.running[:] = [
            request
            for _, request in self._sorted(scheduler, scheduler.running)
        ]
        for queue in scheduler.waiting_queues():
            if not isinstance(queue, deque):
                # The priority policy's heap: the user's order.
                continue
            ordered = self._sorted(scheduler, queue)
            self._count_passed_over(ordered)
            queue.clear()
            queue.extend(request for _, request in ordered)

    def _count_passed_over(self, ordered: list[tuple[int, Request]]) -> None:
        behind_critical = False
        for rank, request in ordered:
            if rank == CRITICAL:
                behind_critical = True
            elif rank == NEW and behind_critical:
                request_id = request.request_id
                self.steps_passed_over[request_id] = (
                    self.steps_passed_over.get(request_id, 0) + 1)

    def _sorted(self, scheduler,
                queue: Iterable[Request]) -> list[tuple[int, Request]]:
        """(rank, request) of a queue's requests in the order to schedule
        them: critical-path and overdue ones by their root's arrival, then
        new ones in their stock order (the sort is stable)."""
        entries = []
        for request in queue:
            request_id = request.request_id
            if self.coordinator.on_critical_path(request_id):
                rank = CRITICAL
            elif self.steps_passed_over.get(request_id, 0) >= self.bound:
                rank = OVERDUE
            else:
                rank = NEW
            entries.append((rank, request))

        def key(entry: tuple[int, Request]) -> tuple[int, float]:
            rank, request = entry
            if rank == NEW:
                return (1, 0.0)
            tree = self.coordinator.tree_of(request.request_id)
            root = (scheduler.requests.get(tree.root.request_id)
                    if tree is not None else None)
            return (0, (root or request).arrival_time)

        return sorted(entries, key=key)
