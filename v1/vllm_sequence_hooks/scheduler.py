# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Promise/sync on vLLM's V1 engine: the scheduler.

Selected with `scheduler_cls` (`--scheduler-cls`) and configured with
`additional_config={"special_kwargs": {...}}` (`config`). The scheduler
overrides only what it must, and holds one helper, its hooks
(`hooks.SequenceHooks`: V1's side of the lifecycle and what the engine
keeps for its trees), which it asks at each upstream moment through their
named calls: before and after a step is scheduled, after the stock
`update_from_output` has appended and stop-checked the step's sampled
tokens, at an abort, an arrival and a prefix-cache lookup. See
docs/v1.md.
"""

from collections import deque
from typing import Any

from vllm_sequence_hooks.config import (REQUEST_CHECK, names_request_check,
                                        refuse_unservable, special_kwargs_of)
from vllm_sequence_hooks.hooks import SequenceHooks
from vllm_sequence_hooks.seams import check_vllm_version

from sequence_hooks.ordering import CriticalPathOrder, Queued
from vllm.config import VllmConfig
from vllm.tokenizers import cached_tokenizer_from_config
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus


class SequenceHookScheduler(Scheduler):
    """V1 scheduler that runs promise/sync sequence hooks.

    - `<promise>` adds a child request whose prompt is the parent's whole
      context (plus the role marker), sharing the parent's KV blocks
      (`parking`), so the child computes only `<promise>` and the marker.
    - `<sync>` with unmerged children parks the parent the way upstream
      parks a streaming-input session. When its children have finished,
      their texts are appended as the session's next input chunk, so the
      resume computes exactly `<sync>` plus the merged tokens.
    - Children's outputs never leave the engine core; the merged tokens and,
      at the end, the tree's snapshot reach the root's output.

    When vLLM's configuration has async scheduling on, constructing this
    class gives an `AsyncSequenceHookScheduler`, the same hooks on
    upstream's `AsyncScheduler`: `--scheduler-cls` names one class either
    way.
    """

    def __new__(cls, *args, **kwargs):
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        if (cls is SequenceHookScheduler
                and vllm_config.scheduler_config.async_scheduling):
            cls = AsyncSequenceHookScheduler
        return super().__new__(cls)

    def __init__(self, vllm_config: VllmConfig, *args, **kwargs) -> None:
        # First: every member reached below was checked on these versions.
        check_vllm_version()
        refuse_unservable(vllm_config)
        # Pipeline parallelism needs nothing of its own: V1 has one
        # scheduler, which the engine core's batch queue drives with up to
        # `max_concurrent_batches` batches in flight, as under async
        # scheduling (docs/running-at-scale.md).
        special_kwargs = special_kwargs_of(vllm_config)
        if not names_request_check(vllm_config):
            raise ValueError(
                f"sequence hooks need --logits-processors {REQUEST_CHECK} "
                "(`hooked_engine_args` adds it): it refuses the requests "
                "they cannot serve (structured outputs) before they reach "
                "the engine")
        super().__init__(vllm_config, *args, **kwargs)
        self.hooks = SequenceHooks(
            self,
            special_kwargs,
            cached_tokenizer_from_config(vllm_config.model_config),
            vllm_config.scheduler_config.policy,
            vllm_config.model_config.served_model_name,
            # The ends the hooks decide skip this class's override.
            end_requests=super().finish_requests)

    def schedule(self, *args, **kwargs) -> SchedulerOutput:
        """Schedules as upstream, critical-path work first, parked parents
        not counted as running (`SequenceHooks.num_parked`) and evicted
        when they alone block the queue."""
        if self.hooks.order is not None:
            order_queues(self, self.hooks.order, self.hooks.waiting_queues())
        self.hooks.before_schedule()
        parked = self.hooks.num_parked()
        self.num_waiting_for_streaming_input -= parked
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self.num_waiting_for_streaming_input += parked
        self.hooks.scheduled(output)
        return output

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput,
    ) -> dict[int, EngineCoreOutputs]:
        """Upstream's update, then the hooks of the sampled tokens and
        their actions."""
        members = self.hooks.members_scheduled(scheduler_output)
        engine_outputs = super().update_from_output(scheduler_output,
                                                    model_runner_output)
        self.hooks.update(scheduler_output, members, engine_outputs)
        return engine_outputs

    def finish_requests(self, request_ids: Any,
                        finished_status: RequestStatus) -> list[Request]:
        """Finishes as upstream; an aborted root takes its tree along.

        Finishing all (``request_ids`` None: a pause that aborts, the
        engine's fault handling) also finishes the roots between calls
        (`SequenceHooks.between_calls`), which hold no request here, and
        returns them with the rest, so that their clients hear of it.
        """
        if isinstance(request_ids, str):
            request_ids = (request_ids, )
        between_calls = []
        if request_ids is None:
            between_calls = self.hooks.between_calls()
            request_ids = [
                *self.requests, *(r.request_id for r in between_calls)
            ]
        request_ids = list(request_ids)
        self.hooks.finishing(request_ids)
        finished = super().finish_requests(request_ids, finished_status)
        for request in between_calls:
            request.status = finished_status
        self.hooks.export_metrics()
        return finished + between_calls

    def _get_local_prefix_cache_hit(self, request: Request, *args):
        """A new child's hit is its parent's computed context
        (`SequenceHooks.prefix_hit`); any other request's is upstream's."""
        hit = self.hooks.prefix_hit(request, *args)
        if hit is None:
            return super()._get_local_prefix_cache_hit(request, *args)
        return hit

    def add_request(self, request: Request) -> None:
        """Adds as upstream; notes the samples of `n > 1` requests."""
        is_new = request.request_id not in self.requests
        super().add_request(request)
        if is_new:
            self.hooks.added(request.request_id)


class AsyncSequenceHookScheduler(SequenceHookScheduler, AsyncScheduler):
    """The hooks on upstream's `AsyncScheduler` (async scheduling on).

    Upstream's async variant keeps output placeholders so that a running
    request's next step is scheduled before its last token came back (the
    engine core keeps two batches in flight). Its bookkeeping runs as it
    is (the method order puts the hooks' overrides first, then
    `AsyncScheduler`'s); what async changes for the hooks is in `parking`:
    a park drops the parked request's step in flight and resumes from its
    computed frontier, and a child's prefix hit is its parent's computed
    context without the positions in flight.
    """


def order_queues(scheduler: SequenceHookScheduler, order: CriticalPathOrder,
                 waiting_queues: tuple[RequestQueue, ...]) -> None:
    """Hands a scheduler's running list and waiting queues to the ordering
    policy both engines share (`sequence_hooks.ordering`), in place.

    V1 schedules its running list front to back, preempts from its back
    when blocks run out (FCFS), then admits the KV-holding and the waiting
    queues front to back. Under the priority policy those two are heaps
    already in the policy's order (priority, then arrival; a member's is
    its root's) and upstream preempts by the same key: only the running
    list is ordered.

    Args:
        scheduler: The scheduler.
        order: The ordering policy.
        waiting_queues: The queues upstream admits from, in its order
            (`SequenceHooks.waiting_queues`).
    """
    if not order.begin_step(lambda: scheduler.requests):
        return
    scheduler.running[:] = order.running(scheduler.running, queued)
    for queue in waiting_queues:
        if isinstance(queue, deque):
            ordered = order.waiting(queue, queued)
            queue.clear()
            queue.extend(ordered)


def queued(request: Request) -> Queued:
    """What the ordering policy reads of a request: a child's priority and
    arrival time are its root's (`restarts.member_request`)."""
    return Queued(request.request_id, request.priority, request.arrival_time)
