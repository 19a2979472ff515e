# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a scheduler puts first when hooks share it with other requests:
one policy for both engines, which hand it their queues before each step.

Both engines' schedulers run their running queue front to back, preempt
from its back when KV blocks run out, then admit waiting requests front to
back until one does not fit. The policy therefore orders the queues:

- FCFS (`critical_path_first`): the work a parked tree waits for (a child
  whose parent is parked, a member resumed after a merge: `CRITICAL`)
  goes first, by its root's arrival, so it is admitted before new requests
  and preempted last. A new request waiting behind such work is passed
  over for the step; after `max_steps_passed_over` such steps it is
  `OVERDUE` and ranks with critical-path work by arrival, so only the
  trees of requests that arrived before it still go first (the starvation
  bound). New requests keep the engine's order among themselves.
- priority (`--scheduling-policy priority`): the user's priority first,
  then arrival, a tree's members carrying their root's arrival time, as V1
  upstream orders its queues and picks the request to preempt. A tree's
  work goes before every request of its priority that arrived after its
  root, with no debt to count: nothing waits on anything that arrived
  later. It holds for every request, with `critical_path_first` on or
  off: where the engine does not order by priority itself (V0's
  chunked-prefill scheduler, the only one hooks use, ignores the policy),
  the queues are ordered every step, tree or not.

When parked parents hold the blocks a waiting request needs,
`eviction_order` says which give them up first.
"""

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import NamedTuple, Optional, TypeVar

from sequence_hooks.lifecycle import Coordinator
from sequence_hooks.special_kwargs import SpecialKwargs

# What a queued request is: on a critical path, a new request passed over
# for the bound, or a new request.
CRITICAL, OVERDUE, NEW = 0, 1, 2

Item = TypeVar("Item")


class Queued(NamedTuple):
    """What the policy reads of a queued request.

    Args:
        request_id: The engine's id (a member's id within a tree).
        priority: The user's priority (lower first); a member's is its
            root's.
        arrival_time: When it arrived; a member's is its root's.
    """
    request_id: str
    priority: int
    arrival_time: float


class CriticalPathOrder:
    """Orders a scheduler's queues by the policy above, and counts the
    steps each new request is passed over.

    Args:
        coordinator: The lifecycle: which requests are on a critical path.
        bound: Steps a new request may be passed over
            (`max_steps_passed_over`).
        by_priority: Whether the scheduler's policy is priority.
        every_step: Order the queues every step, tree or not (the engine
            does not order them by the policy itself).
    """

    def __init__(self,
                 coordinator: Coordinator,
                 bound: int,
                 by_priority: bool,
                 every_step: bool = False) -> None:
        self.coordinator = coordinator
        self.bound = bound
        self.by_priority = by_priority
        self.every_step = every_step
        # New requests passed over by critical-path work, by request id:
        # steps so far (FCFS only).
        self.steps_passed_over: dict[str, int] = {}

    @classmethod
    def for_scheduler(
            cls, coordinator: Coordinator, special_kwargs: SpecialKwargs,
            policy: str,
            engine_orders_by_priority: bool) -> Optional["CriticalPathOrder"]:
        """The order a scheduler hands its queues to, if any.

        Args:
            coordinator: The lifecycle.
            special_kwargs: The hooks' settings (`critical_path_first`,
                `max_steps_passed_over`).
            policy: The scheduler's policy, "fcfs" or "priority".
            engine_orders_by_priority: Whether the engine's own scheduler
                orders plain requests by priority under that policy (V1
                does, V0's chunked-prefill scheduler does not).

        Returns:
            The order, or None where the engine's own order is the rule:
            FCFS with `critical_path_first` off.
        """
        by_priority = policy == "priority"
        if not (by_priority or special_kwargs.critical_path_first):
            return None
        return cls(coordinator,
                   special_kwargs.max_steps_passed_over,
                   by_priority,
                   every_step=by_priority and not engine_orders_by_priority)

    def begin_step(self, queued: Callable[[], Collection[str]]) -> bool:
        """Forgets the debts of requests no longer queued.

        Args:
            queued: Gives the ids of every request in the scheduler's
                queues (called only when there is something to order: it
                runs every step).

        Returns:
            Whether to order the queues this step: with no live tree and
            no debt the engine's own order stands, at no cost (plain
            requests are scheduled as without hooks), unless the engine
            does not order by the policy itself (`every_step`).
        """
        if not (self.every_step or self.coordinator.num_members()
                or self.steps_passed_over):
            return False
        live = queued()
        self.steps_passed_over = {
            request_id: steps
            for request_id, steps in self.steps_passed_over.items()
            if request_id in live
        }
        return True

    def rank(self, request_id: str) -> int:
        """`CRITICAL`, `OVERDUE` or `NEW`.

        Args:
            request_id: A queued request's id.

        Returns:
            Its rank this step.
        """
        if self.coordinator.on_critical_path(request_id):
            return CRITICAL
        if self.steps_passed_over.get(request_id, 0) >= self.bound:
            return OVERDUE
        return NEW

    def running(self, queue: Iterable[Item],
                describe: Callable[[Item], Queued]) -> list[Item]:
        """The running queue in the order to schedule it (preempted from
        its back).

        Args:
            queue: The engine's running queue, in its order.
            describe: Reads what the policy needs of an entry.

        Returns:
            Its entries, reordered.
        """
        return [item for _, _, item in self._sorted(queue, describe)]

    def waiting(self, queue: Iterable[Item],
                describe: Callable[[Item], Queued]) -> list[Item]:
        """A waiting queue in the order to admit it; under FCFS, each new
        request behind critical-path work is counted as passed over.

        Args:
            queue: A waiting queue of the engine, in its order.
            describe: Reads what the policy needs of an entry.

        Returns:
            Its entries, reordered.
        """
        ordered = self._sorted(queue, describe)
        if not self.by_priority:
            behind_critical = False
            for rank, request_id, _ in ordered:
                if rank == CRITICAL:
                    behind_critical = True
                elif rank == NEW and behind_critical:
                    self.steps_passed_over[request_id] = (
                        self.steps_passed_over.get(request_id, 0) + 1)
        return [item for _, _, item in ordered]

    def _sorted(
            self, queue: Iterable[Item],
            describe: Callable[[Item], Queued]) -> list[tuple[int, str, Item]]:
        """(rank, request id, entry) in the order to schedule them; the
        sort is stable, so ties keep the engine's order."""
        entries = []
        for item in queue:
            queued = describe(item)
            rank = NEW if self.by_priority else self.rank(queued.request_id)
            entries.append((self._key(rank,
                                      queued), rank, queued.request_id, item))
        entries.sort(key=lambda entry: entry[0])
        return [(rank, request_id, item)
                for _, rank, request_id, item in entries]

    def _key(self, rank: int, queued: Queued) -> tuple:
        if self.by_priority:
            return (queued.priority, queued.arrival_time)
        return (0, queued.arrival_time) if rank != NEW else (1, 0.0)


def eviction_order(parked: Mapping[str, float], evicted: Collection[str],
                   protected: Collection[str]) -> list[str]:
    """Which parked parents give up their KV blocks first, when they alone
    hold the blocks a waiting request needs: the most recently parked
    first (the least work is lost), the request's own ancestors last
    (their blocks are its prefix hit).

    Args:
        parked: When each parked member was parked.
        evicted: Parked members whose blocks are already freed.
        protected: The ancestors of the request that needs the blocks.

    Returns:
        The ids of the parked members still holding blocks, in the order
        to evict them.
    """
    holders = [(since, member_id) for member_id, since in parked.items()
               if member_id not in evicted]
    holders.sort(key=lambda since_and_id:
                 (since_and_id[1] in protected, -since_and_id[0]))
    return [member_id for _, member_id in holders]
