# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`critical_path_first` on V1, model-free: the real scheduler, driven as
the engine core drives it (`v1_batch_queue`), two requests at a time
(`max_num_seqs` = 2) with new requests queued behind a tree.

With it on (the default), the child a parked parent waits for goes
before new requests, so the tree finishes while the first new requests
still run, and under KV pressure new requests are preempted before it;
with it off, the stock order: the child waits behind every new request
that arrived before it was promised. A new request passed over too often
is overdue and ranks by arrival (the starvation bound).
"""

import pytest
from vllm_sequence_hooks.scheduler import SequenceHookScheduler, queued

from sequence_hooks.ordering import CRITICAL, NEW, OVERDUE, CriticalPathOrder
from sequence_hooks_testkit.priority_case import (ADMITTED, ARRIVALS, CHILD,
                                                  PLAIN_WAITING, PRIORITY,
                                                  WAITING)
from sequence_hooks_testkit.v1_batch_queue import (FILLER, BatchQueueDriver,
                                                   make_request,
                                                   make_scheduler)
from sequence_hooks_testkit.v1_engines import preempted_requests

PLAIN_LEN = 30


def sampler(hook_ids):
    """"tree" promises at its first position, syncs at its second and ends
    at its eighth; its child writes six tokens; the plain requests
    ``PLAIN_LEN``."""

    def sample(request_id: str, position: int) -> int:
        if request_id == "tree":
            return {
                0: FILLER,
                1: hook_ids.promise,
                2: hook_ids.sync
            }.get(position, hook_ids.eos if position >= 8 else FILLER)
        if "/promise-" in request_id:
            return hook_ids.eos if position >= 6 else FILLER
        return hook_ids.eos if position >= PLAIN_LEN else FILLER

    return sample


def hooked_scheduler(model_path, ids, hook_options: dict,
                     **scheduler_options) -> SequenceHookScheduler:
    """A model-free `SequenceHookScheduler` (no async scheduling) hooked on
    ``ids`` with the further `SpecialKwargs` fields ``hook_options``;
    ``scheduler_options`` as `make_scheduler` takes them."""
    return make_scheduler(SequenceHookScheduler, model_path, False, {
        "sync_token_id": ids.sync,
        "promise_token_id": ids.promise,
        **hook_options
    }, **scheduler_options)


def finish_order(tiny_model_path, hook_ids, critical_path_first: bool):
    scheduler = hooked_scheduler(tiny_model_path,
                                 hook_ids,
                                 {"critical_path_first": critical_path_first},
                                 max_num_seqs=2)
    driver = BatchQueueDriver(scheduler, sampler(hook_ids), depth=1)
    for request_id in ["tree", "new-0", "new-1", "new-2", "new-3"]:
        driver.add(
            make_request(scheduler, request_id, [FILLER + 1] * 8, 64,
                         hook_ids.eos))
    driver.run()
    assert scheduler.requests == {}
    return [
        request_id for request_id, _, reason in driver.outputs
        if reason is not None
    ]


def test_the_tree_goes_before_new_requests(tiny_model_path, hook_ids):
    order = finish_order(tiny_model_path, hook_ids, True)
    # The child runs beside new-0 as soon as its parent parks; the parent
    # resumes before new-1 is admitted.
    assert order.index("tree") < order.index("new-0") < order.index("new-1")


def test_off_the_child_waits_behind_new_requests(tiny_model_path, hook_ids):
    order = finish_order(tiny_model_path, hook_ids, False)
    assert order.index("new-1") < order.index("tree")


def test_a_passed_over_request_is_overdue_after_the_bound(
        tiny_model_path, hook_ids):
    """The starvation bound: a new request passed over `bound` times ranks
    with critical-path work, by arrival."""
    scheduler = hooked_scheduler(tiny_model_path,
                                 hook_ids, {"max_steps_passed_over": 2},
                                 max_num_seqs=1)
    driver = BatchQueueDriver(scheduler, sampler(hook_ids), depth=1)
    driver.add(
        make_request(scheduler, "tree", [FILLER + 1] * 8, 64, hook_ids.eos))
    # The tree promises and parks; its child is queued.
    while not scheduler.hooks.coordinator.num_parked():
        driver.step()
    late = make_request(scheduler, "new-0", [FILLER + 2] * 8, 64, hook_ids.eos)
    driver.add(late)
    order = scheduler.hooks.order
    assert isinstance(order, CriticalPathOrder)
    ranks = {
        request.request_id: order.rank(request.request_id)
        for request in scheduler.waiting
    }
    assert ranks == {"tree/promise-0": CRITICAL, "new-0": NEW}

    def admission_order() -> list[str]:
        return [
            request.request_id
            for request in order.running(scheduler.waiting, queued)
        ]

    order.steps_passed_over["new-0"] = 2
    assert order.rank("new-0") == OVERDUE
    assert admission_order() == ["tree/promise-0", "new-0"]
    # Overdue now, but it arrived after the tree: the tree still goes
    # first; an overdue request that arrived first would not wait.
    late.arrival_time = scheduler.requests["tree"].arrival_time - 1
    assert admission_order() == ["new-0", "tree/promise-0"]


@pytest.mark.parametrize("critical_path_first", [True, False])
def test_every_request_finishes_either_way(tiny_model_path, hook_ids,
                                           critical_path_first):
    order = finish_order(tiny_model_path, hook_ids, critical_path_first)
    assert sorted(order) == ["new-0", "new-1", "new-2", "new-3", "tree"]


def test_critical_path_work_is_preempted_last(tiny_model_path, hook_ids,
                                              monkeypatch):
    """A pool too small for the tree's child and three new requests: the
    scheduler preempts from the back of its running list, which the order
    puts the child at the front of (it was admitted last)."""
    scheduler = hooked_scheduler(tiny_model_path,
                                 hook_ids, {},
                                 num_blocks=12,
                                 max_num_seqs=4)
    preempted = preempted_requests(scheduler, monkeypatch)

    def sample(request_id: str, position: int) -> int:
        if request_id == "tree":
            return {
                1: hook_ids.promise,
                2: hook_ids.sync
            }.get(position, hook_ids.eos if position >= 8 else FILLER)
        return hook_ids.eos if position >= 40 else FILLER

    driver = BatchQueueDriver(scheduler, sample, depth=1)
    for request_id in ["tree", "new-0", "new-1", "new-2"]:
        driver.add(
            make_request(scheduler, request_id, [FILLER + 1] * 8, 64,
                         hook_ids.eos))
    driver.run()
    assert preempted, "the pool was large enough: nothing was preempted"
    assert "tree/promise-0" not in preempted
    assert scheduler.requests == {}


@pytest.mark.parametrize("critical_path_first", [True, False])
def test_with_the_priority_policy_priority_then_arrival_decide(
        tiny_model_path, hook_ids, critical_path_first):
    """The priority rule's case (`priority_case`) on V1's scheduler, as
    `mytests/engine/test_critical_path_scheduling.py` plays it on V0's:
    the waiting queue is upstream's heap, a child carrying its root's
    arrival time and priority; with `critical_path_first` on or off."""
    scheduler, driver = priority_case_arrived(
        tiny_model_path,
        hook_ids,
        promises=True,
        critical_path_first=critical_path_first)
    parent = scheduler.requests["parent"]
    while not scheduler.hooks.coordinator.num_parked():
        driver.step()
    child = scheduler.requests[CHILD]
    assert (child.priority, child.arrival_time) == (PRIORITY,
                                                    parent.arrival_time)

    output = scheduler.schedule()
    scheduled = {r.req_id
                 for r in output.scheduled_new_reqs} | set(
                     output.scheduled_cached_reqs.req_ids)
    assert scheduled == {"busy", ADMITTED}
    assert [request.request_id for request in scheduler.waiting] == WAITING


@pytest.mark.parametrize("critical_path_first", [True, False])
def test_with_the_priority_policy_plain_requests_wait_by_priority(
        tiny_model_path, hook_ids, critical_path_first):
    """The plain case (`priority_case`): upstream's heap orders it."""
    scheduler, _ = priority_case_arrived(
        tiny_model_path,
        hook_ids,
        promises=False,
        critical_path_first=critical_path_first)
    output = scheduler.schedule()
    assert set(output.scheduled_cached_reqs.req_ids) == {"parent", "busy"}
    assert not output.scheduled_new_reqs
    assert [request.request_id
            for request in scheduler.waiting] == PLAIN_WAITING


def priority_case_arrived(model_path, ids, promises: bool, **hook_options):
    """`priority_case`'s scheduler after its arrivals.

    Args:
        model_path: The tiny model.
        ids: Its hook ids.
        promises: Whether "parent" promises, then syncs.
        hook_options: Further `SpecialKwargs` fields.

    Returns:
        The scheduler and its driver.
    """
    scheduler = hooked_scheduler(model_path,
                                 ids,
                                 hook_options,
                                 max_num_seqs=2,
                                 policy="priority")

    def sample(request_id: str, position: int) -> int:
        if promises and request_id == "parent":
            return {0: ids.promise, 1: ids.sync}.get(position, FILLER)
        return FILLER

    driver = BatchQueueDriver(scheduler, sample, depth=1)
    for request_id in ["parent", "busy"]:
        driver.add(
            make_request(scheduler,
                         request_id, [FILLER + 1] * 8,
                         64,
                         ids.eos,
                         priority=PRIORITY))
    driver.step()
    parent = scheduler.requests["parent"]
    for request_id, priority, after_parent in ARRIVALS:
        request = make_request(scheduler,
                               request_id, [FILLER + 1] * 8,
                               64,
                               ids.eos,
                               priority=priority)
        request.arrival_time = parent.arrival_time + after_parent
        driver.add(request)
    return scheduler, driver
