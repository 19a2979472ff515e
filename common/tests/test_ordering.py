# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ordering policy both schedulers hand their queues to
(`sequence_hooks.ordering`), on the model-free engine: ranks, the
passed-over count and its bound, the priority rule, and which parked
parent gives up its blocks first.

Queue entries are `Queued` tuples themselves (``describe`` is the
identity); what is on a critical path comes from a real coordinator
driven by `FakeEngine`.
"""

import pytest
from fake_engine import OFFSET, PROMISE, SYNC, FakeEngine

from sequence_hooks.actions import RequestParams
from sequence_hooks.ordering import (CRITICAL, NEW, OVERDUE, CriticalPathOrder,
                                     Queued, eviction_order)
from sequence_hooks.special_kwargs import SpecialKwargs

CHILD = "tree/promise-0"
# The tree's root arrived at 10.0: its child carries that arrival.
ROOT_ARRIVAL = 10.0


def park(engine: FakeEngine, request_id: str) -> None:
    """A new request that promises once and syncs: parked, its child the
    work it waits for."""
    engine.add_request(request_id, [OFFSET], RequestParams(1, None))
    engine.sample(request_id, PROMISE)
    engine.sample(request_id, SYNC)


def parked_tree() -> FakeEngine:
    """A request "tree" whose child is the work its parked root waits
    for."""
    engine = FakeEngine()
    park(engine, "tree")
    assert engine.coordinator.on_critical_path(CHILD)
    return engine


def ids(queue: list[Queued]) -> list[str]:
    return [queued.request_id for queued in queue]


def same(queued: Queued) -> Queued:
    return queued


def fcfs_queue() -> list[Queued]:
    """New requests around the child, in the engine's order."""
    return [
        Queued("late", 0, ROOT_ARRIVAL + 5),
        Queued(CHILD, 0, ROOT_ARRIVAL),
        Queued("early", 0, ROOT_ARRIVAL - 5),
    ]


def test_critical_path_work_goes_first_and_new_requests_keep_their_order():
    order = CriticalPathOrder(parked_tree().coordinator, 3, False)
    assert order.begin_step(lambda: ids(fcfs_queue()))
    assert [order.rank(i) for i in ids(fcfs_queue())] == [NEW, CRITICAL, NEW]
    assert ids(order.waiting(fcfs_queue(), same)) == [CHILD, "late", "early"]
    assert order.steps_passed_over == {"late": 1, "early": 1}
    # The running queue is ordered the same way, and counts nothing.
    assert ids(order.running(fcfs_queue(), same)) == [CHILD, "late", "early"]
    assert order.steps_passed_over == {"late": 1, "early": 1}


def test_only_new_requests_behind_critical_work_are_passed_over():
    order = CriticalPathOrder(parked_tree().coordinator, 3, False)
    order.waiting([Queued("alone", 0, 1.0)], same)
    assert order.steps_passed_over == {}


@pytest.mark.parametrize("bound", [1, 2, 3])
def test_after_the_bound_a_new_request_ranks_by_arrival(bound):
    """Overdue, a request goes before the trees of requests that arrived
    after it, never before earlier ones'."""
    order = CriticalPathOrder(parked_tree().coordinator, bound, False)
    for step in range(bound):
        assert order.rank("early") == NEW
        assert ids(order.waiting(fcfs_queue(),
                                 same)) == [CHILD, "late", "early"]
    assert order.rank("early") == order.rank("late") == OVERDUE
    assert ids(order.waiting(fcfs_queue(), same)) == ["early", CHILD, "late"]


def test_no_tree_and_no_debt_leave_the_engines_order():
    engine = FakeEngine()
    order = CriticalPathOrder(engine.coordinator, 3, False)
    assert not order.begin_step(lambda: {"a", "b"})
    # Either policy, where the engine orders by it: plain requests keep
    # the engine's own order.
    assert not CriticalPathOrder(engine.coordinator, 3,
                                 True).begin_step(lambda: {"a", "b"})
    order.steps_passed_over = {"a": 2, "gone": 1}
    # A debt is work: ordering goes on, and forgets who left the queues.
    assert order.begin_step(lambda: {"a", "b"})
    assert order.steps_passed_over == {"a": 2}


def test_under_priority_the_users_priority_then_arrival_decide():
    """The priority rule (both engines): priority first, then arrival, a
    tree's work carrying its root's; no passed-over debt."""
    order = CriticalPathOrder(parked_tree().coordinator, 1, True)
    queue = [
        Queued("same", 1, ROOT_ARRIVAL + 1),
        Queued(CHILD, 1, ROOT_ARRIVAL),
        Queued("urgent", 0, ROOT_ARRIVAL + 2),
        Queued("early", 1, ROOT_ARRIVAL - 1),
        Queued("low", 2, 0.0),
    ]
    assert order.begin_step(set)
    for _ in range(3):
        assert ids(order.waiting(
            queue, same)) == ["urgent", "early", CHILD, "same", "low"]
    assert ids(order.running(
        queue, same)) == ["urgent", "early", CHILD, "same", "low"]
    assert order.steps_passed_over == {}


def test_the_newest_parked_parent_is_evicted_first_ancestors_last():
    parked = {"old": 1.0, "newest": 3.0, "middle": 2.0, "gone": 4.0}
    assert eviction_order(parked, {"gone"},
                          set()) == ["newest", "middle", "old"]
    assert eviction_order(parked, {"gone"},
                          {"newest"}) == ["middle", "old", "newest"]
    assert eviction_order({}, set(), set()) == []


def test_a_coordinators_parked_members_are_its_eviction_candidates():
    engine = FakeEngine()
    park(engine, "other")
    park(engine, "tree")
    coordinator = engine.coordinator
    parked = coordinator.parked_members()
    assert eviction_order(parked, set(), set()) == ["tree", "other"]
    # For the tree's own child, its parked root goes last: its blocks are
    # the child's prefix hit.
    assert eviction_order(parked, set(),
                          coordinator.ancestors(CHILD)) == ["other", "tree"]


@pytest.mark.parametrize("critical_path_first", [True, False])
@pytest.mark.parametrize("engine_orders_by_priority", [True, False])
def test_the_priority_rule_holds_with_or_without_critical_path_first(
        critical_path_first, engine_orders_by_priority):
    """Under priority the rule is the user's, not `critical_path_first`'s:
    an engine that does not order by priority itself (V0) gets its queues
    ordered every step, plain requests included."""
    engine = FakeEngine()
    special_kwargs = SpecialKwargs(sync_token_id=SYNC,
                                   promise_token_id=PROMISE,
                                   critical_path_first=critical_path_first)
    order = CriticalPathOrder.for_scheduler(engine.coordinator, special_kwargs,
                                            "priority",
                                            engine_orders_by_priority)
    assert order is not None and order.by_priority
    # No tree: only an engine that does not order by priority is ordered.
    assert order.begin_step(set) is not engine_orders_by_priority
    plain = [
        Queued("late", 0, 2.0),
        Queued("low", 1, 0.0),
        Queued("early", 0, 1.0)
    ]
    assert ids(order.waiting(plain, same)) == ["early", "late", "low"]


@pytest.mark.parametrize("critical_path_first", [True, False])
def test_under_fcfs_critical_path_first_decides_whether_to_order(
        critical_path_first):
    special_kwargs = SpecialKwargs(sync_token_id=SYNC,
                                   promise_token_id=PROMISE,
                                   critical_path_first=critical_path_first,
                                   max_steps_passed_over=4)
    for engine_orders_by_priority in (True, False):
        order = CriticalPathOrder.for_scheduler(FakeEngine().coordinator,
                                                special_kwargs, "fcfs",
                                                engine_orders_by_priority)
        if not critical_path_first:
            assert order is None
            continue
        assert order is not None
        assert (order.bound, order.by_priority) == (4, False)
        assert not order.begin_step(set)
