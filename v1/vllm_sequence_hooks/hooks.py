# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The V1 engine's side of the promise/sync lifecycle (or a format's).

`SequenceHooks` is the one object the scheduler holds, asked only through
its named calls (each an upstream moment: a step scheduled, its outputs,
an abort, an arrival, a prefix-cache lookup) and for its queues' order
(`order`). It turns a step's outputs
into the lifecycle's events, has the actions returned carried out on V1
requests (`carry_out`), and holds what the engine keeps for its trees'
requests (`members`).

A step's outputs go down into the lifecycle once, each at most one event
whose actions are carried out at once; the members' ends the engine finds
meanwhile (upstream finished a request, a stop string, a `Conclude`) are
reported right after, in order, from one place (`_report_ends`). The
outputs that leave the engine core then get their stop-string checks and
trees; last, the records of the requests that ended go.
"""

import time
from typing import Any, Callable, Optional

from vllm_sequence_hooks.carry_out import ActionCarrier
from vllm_sequence_hooks.members import Members
from vllm_sequence_hooks.parking import KvParking
from vllm_sequence_hooks.splicing import Splicing
from vllm_sequence_hooks.step import End, Step
from vllm_sequence_hooks.stop_strings import StopStringCheck, cut_at_stop

from sequence_hooks.actions import RequestParams
from sequence_hooks.formats import RESTART, SPLICE, format_named
from sequence_hooks.lifecycle import Coordinator
from sequence_hooks.metrics import SequenceHookMetrics
from sequence_hooks.ordering import CriticalPathOrder, eviction_order
from sequence_hooks.special_kwargs import SpecialKwargs
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus


def params_of(request: Request) -> RequestParams:
    """What the lifecycle reads of a V1 request."""
    return RequestParams.of(request.num_prompt_tokens, request.max_tokens,
                            request.sampling_params)


class SequenceHooks:
    """Runs promise/sync trees on one V1 scheduler, and keeps what the
    engine holds for them.

    Args:
        scheduler: The `SequenceHookScheduler` that holds it.
        special_kwargs: The hook configuration, resolved to ids.
        tokenizer: The model's tokenizer (merges tokenize texts).
        policy: The scheduler's policy ("fcfs" or "priority").
        served_model_name: The metrics' model label.
        end_requests: Upstream's `finish_requests`, for the ends the hooks
            decide themselves (the lifecycle already knows of them).
    """

    def __init__(self, scheduler: Any, special_kwargs: SpecialKwargs,
                 tokenizer: Any, policy: str, served_model_name: Any,
                 end_requests: Callable[[Any, RequestStatus], Any]) -> None:
        self.scheduler = scheduler
        self.special_kwargs = special_kwargs
        self.tokenizer = tokenizer
        self.end_requests = end_requests
        # V0's `vllm:sequence_hook_*` metrics (docs/v1.md: how they reach
        # `/metrics` from the engine core's process).
        self.metrics = SequenceHookMetrics(served_model_name)
        # The model runner keeps a resumed session's generator: no
        # resume reseeds.
        self.coordinator = Coordinator.for_format(special_kwargs,
                                                  scheduler.max_model_len,
                                                  tokenizer,
                                                  clock=time.monotonic)
        # The queues' order before each step (upstream's own heaps order
        # plain requests by priority under that policy).
        self.order = CriticalPathOrder.for_scheduler(
            self.coordinator,
            special_kwargs,
            policy,
            engine_orders_by_priority=True)
        # Whether the format makes calls anew (none of that bookkeeping
        # runs for promise/sync).
        self.restarts = RESTART in format_named(special_kwargs.format).needs
        self.members = Members()
        self.parking = KvParking(scheduler)
        # The splice joins' mechanics, for a format that splices.
        self.splicing = (Splicing(scheduler) if SPLICE in format_named(
            special_kwargs.format).needs else None)
        self.carrier = ActionCarrier(scheduler, self.members, self.parking,
                                     self.coordinator, tokenizer, end_requests,
                                     special_kwargs.critical_path_first,
                                     self.restarts, self.splicing)

    # The scheduler's calls.

    def waiting_queues(self) -> tuple[RequestQueue, RequestQueue]:
        """The queues upstream admits from, in its order (the ordering
        policy sorts them).

        Returns:
            The KV-holding waiting queue, then the waiting queue.
        """
        return self.parking.waiting_queues()

    def before_schedule(self) -> None:
        """Before upstream schedules a step: while nothing runs, parked
        parents that alone hold the blocks the next request needs free
        them, in the order both engines share (`eviction_order`: the
        newest first, the request's own ancestors, its prefix hit, last)."""
        parked = self.parking.sessions(self.coordinator.parked_members())
        request = self.parking.next_admission() if parked else None
        if request is None:
            return
        evicted = self.members.evicted()
        record = self.members.get(request.request_id)
        victims = eviction_order(
            parked, evicted, self.coordinator.ancestors(request.request_id))
        for member_id in self.parking.evict_until_fits(
                request, None if record is None else record.fork, victims,
                evicted):
            self.members.record(member_id).evicted = True

    def num_parked(self) -> int:
        """Parked parents: upstream counts them as streaming sessions
        against `max_num_seqs`, which the scheduler undoes for its step.

        A parked parent holds no row of the model runner's batch (it drops
        unscheduled requests from it), and counting it could leave its own
        children waiting forever once parents fill the limit.

        Returns:
            The parked parents held as sessions.
        """
        return len(self.parking.sessions(self.coordinator.parked_members()))

    def scheduled(self, scheduler_output: SchedulerOutput) -> None:
        """A step was scheduled: its requests' steps are in flight (counted
        while the format makes calls anew); the metrics exported."""
        if self.restarts:
            self.members.in_flight.scheduled(scheduler_output)
        if self.splicing is not None:
            self.splicing.scheduled(scheduler_output)
        self.export_metrics()

    def members_scheduled(
            self, scheduler_output: SchedulerOutput) -> dict[str, Request]:
        """Tree members scheduled this step, read before upstream's update
        (finished members leave `requests` there); a splicing format's
        closing paths among them are held across it (`Splicing.hold`).

        Args:
            scheduler_output: The step's scheduler output.

        Returns:
            Their requests by id.
        """
        coordinator, requests = self.coordinator, self.scheduler.requests
        if not coordinator.num_members():
            return {}
        members = {
            request_id: requests[request_id]
            for request_id in scheduler_output.num_scheduled_tokens
            if coordinator.is_member(request_id) and request_id in requests
        }
        if self.splicing is not None:
            self.splicing.hold(members)
        return members

    def update(
        self,
        scheduler_output: SchedulerOutput,
        members: dict[str, Request],
        engine_outputs: dict[int, EngineCoreOutputs],
    ) -> None:
        """Runs the hooks of a step's outputs, in place: the events of the
        sampled tokens, their actions and the ends found; children's and
        held roots' outputs removed. Then calls made anew whose old call
        has no step in flight any more start.

        Args:
            scheduler_output: The step's scheduler output.
            members: `members_scheduled` of this step.
            engine_outputs: Upstream's outputs of this step.
        """
        if self.splicing is not None:
            self.splicing.settle_held(self.coordinator.root_of)
        if (members or len(self.members.sample_trees)
                or self._sampled_a_fork(engine_outputs)):
            self._run_step(members, engine_outputs)
            self.export_metrics()
        # (Else no tree, no sample of an `n > 1` request, no promise or
        # format trigger: the stock outputs as they are, the hot path
        # without hooks.)
        if self.restarts:
            for request in self.members.landed(scheduler_output):
                self.scheduler.add_request(request)
        if self.splicing is not None:
            self.splicing.landed(scheduler_output)

    def finishing(self, request_ids: list[str]) -> None:
        """Requests upstream's `finish_requests` ends (an abort from
        outside, whoever asked): an aborted root takes its tree along.

        Args:
            request_ids: The requests' ids.
        """
        step = Step(ended=set(request_ids))
        for request_id in request_ids:
            if (self.coordinator.is_member(request_id)
                    and not self.coordinator.is_child(request_id)):
                self.carrier.carry_out(self.coordinator.aborted(request_id),
                                       step)
                if self.splicing is not None:
                    self.splicing.release_root(request_id)
        self._settle(step)

    def added(self, request_id: str) -> None:
        """A new request: notes the samples of `n > 1` requests; an event
        for the coordinator (a format whose trees start at arrival). A
        member's new call (a fresh child, a call made anew) is none.

        Args:
            request_id: Its id.
        """
        if self.coordinator.is_member(request_id):
            return
        self.members.sample_trees.added(request_id)
        if not self.coordinator.trees_start_at_arrival:
            return
        request = self.scheduler.requests[request_id]
        step = Step()
        self.carrier.carry_out(
            self.coordinator.arrived(request_id, request.prompt_token_ids,
                                     params_of(request)), step)
        self._settle(step)

    def prefix_hit(self, request: Request, *args) -> Optional[tuple]:
        """A new child's prefix-cache hit: its parent's computed context
        (`KvParking.prefix_hit`), asked once.

        Args:
            request: The request upstream looks up.
            *args: What else upstream passes (`KvParking.prefix_hit`).

        Returns:
            Upstream's tuple; None if ``request`` is no new child
            (upstream's lookup answers).
        """
        record = self.members.get(request.request_id)
        if record is None or record.fork is None:
            return None
        fork, record.fork = record.fork, None
        return self.parking.prefix_hit(request, fork, self.members.evicted(),
                                       *args)

    def between_calls(self) -> list[Request]:
        """The roots of formats' trees with no request in the scheduler
        (their sub-searches running, or a call made anew waiting for the
        old one's steps in flight).

        Returns:
            Their requests as they arrived.
        """
        return [
            record.template for root_id, record in self.members.items()
            if record.template is not None
            and root_id not in self.scheduler.requests
        ]

    def export_metrics(self) -> None:
        """Exports the lifecycle's counts and the KV cache's usage."""
        self.metrics.export(self.coordinator.counts)
        self.metrics.kv_cache_usage.set(self.scheduler.kv_cache_manager.usage)

    # One step.

    def _run_step(self, members: dict[str, Request],
                  engine_outputs: dict[int, EngineCoreOutputs]) -> None:
        step = Step({
            out.request_id: out
            for outputs in engine_outputs.values()
            for out in outputs.outputs
        })
        # Decided before the hooks run: a finished root drops its tree.
        children = {
            request_id: self.coordinator.root_of(request_id)
            for request_id in step.outputs
            if self.coordinator.is_child(request_id)
        }
        requests = self.scheduler.requests
        for outputs in engine_outputs.values():
            for out in list(outputs.outputs):
                request = (members.get(out.request_id)
                           or requests.get(out.request_id))
                if request is not None:
                    self._on_output(request, out, step)
                    self._report_ends(step)
            # Children never report to the frontend, nor do held roots
            # before their end.
            outputs.outputs = self.members.shown(outputs.outputs, children)
        for client_index, outputs in step.extra.items():
            engine_outputs.setdefault(
                client_index, EngineCoreOutputs()).outputs.extend(outputs)
        for outputs in engine_outputs.values():
            for out in outputs.outputs:
                self.members.give_preemptions(out)
                if out.finish_reason is None:
                    self._check_stop_string(out, step)
                if out.finish_reason is not None:
                    self.members.sample_trees.finished(out)
                    step.ended.add(out.request_id)
        self._settle(step)

    def _sampled_a_fork(self, engine_outputs: dict[int,
                                                   EngineCoreOutputs]) -> bool:
        fork = self.coordinator.forking_token_id
        return any(out.new_token_ids and out.new_token_ids[-1] == fork
                   for outputs in engine_outputs.values()
                   for out in outputs.outputs)

    def _on_output(self, request: Request, out: EngineCoreOutput,
                   step: Step) -> None:
        """A member's output: its end, or its sampled token's event."""
        if out.finish_reason is None and request.is_finished():
            # Aborted earlier in this step, with its finished ancestor.
            return
        request_id = request.request_id
        if self.coordinator.is_finished(request_id):
            return
        record = self.members.get(request_id)
        if record is not None and record.logprobs is not None:
            record.logprobs.sampled(out.new_logprobs)
        if out.finish_reason is not None:
            if self.coordinator.is_member(request_id):
                step.ends.append(End(request, str(out.finish_reason)))
            else:
                # A child whose tree ended earlier in this step.
                step.ended.add(request_id)
            return
        if not out.new_token_ids:
            return
        if (record is not None and record.stop is not None
                and self.coordinator.is_child(request_id)):
            check = record.stop.feed_new(request)
            if check is not None:
                # As V0's stop checker: the child ends, its text cut (a
                # path that splices keeps its blocks for its join).
                if self.splicing is not None:
                    self.splicing.retain(request,
                                         self.coordinator.root_of(request_id))
                self.end_requests(request_id, RequestStatus.FINISHED_STOPPED)
                step.ends.append(End(request, "stop", check.output_text))
                return
        actions = self.coordinator.sampled(
            request_id, request.all_token_ids, lambda: params_of(request),
            None if record is None or record.logprobs is None else
            record.logprobs.entries)
        if actions:
            # Most tokens are no event: no call on the hot path.
            self.carrier.carry_out(actions, step)

    def _check_stop_string(self, out: EngineCoreOutput, step: Step) -> None:
        """Ends a request whose outgoing output completes a stop string,
        if its outputs carry trees (a root's, or a sample's whose siblings
        have trees): the frontend finds the same stop (`stop_strings`)."""
        request_id = out.request_id
        request = self.scheduler.requests.get(request_id)
        if (request is None or request.is_finished()
                or not request.sampling_params.stop):
            return
        coordinator = self.coordinator
        is_member = coordinator.is_member(request_id)
        record = self.members.get(request_id)
        if record is None or record.stop is None:
            if not (is_member or self.members.sample_trees.carries_trees(
                    request_id, coordinator.is_member)):
                return
            start = (coordinator.own_start(request_id)
                     if is_member else request.num_prompt_tokens)
            record = self.members.record(request_id)
            record.stop = StopStringCheck(self.tokenizer, request, start,
                                          len(out.new_token_ids))
        check = record.stop.feed(out.new_token_ids)
        if check is None:
            return
        cut_at_stop(out, record.stop.num_kept)
        self.end_requests(request_id, RequestStatus.FINISHED_STOPPED)
        if is_member:
            # As on V0: live children are aborted, the root stops there;
            # its tokens end where the frontend cuts them.
            step.outputs[request_id] = out
            step.ends.append(
                End(request, "stop", check.output_text,
                    list(check.output_token_ids)))
            self._report_ends(step)
        # The frontend finds the same stop string and reports it; were it
        # not to, the request would end aborted rather than wait forever.
        out.finish_reason = FinishReason.ABORT

    def _report_ends(self, step: Step) -> None:
        """Reports the members' ends found so far, in order, as
        `finished` events, and carries out their actions (which may find
        more: a `Conclude`)."""
        coordinator = self.coordinator
        while step.ends:
            end = step.ends.popleft()
            member_id = end.request.request_id
            step.ended.add(member_id)
            if (not coordinator.is_member(member_id)
                    or coordinator.is_finished(member_id)):
                # Its tree ended (or it was aborted) after it was found.
                continue
            result = end.result(self.tokenizer,
                                coordinator.own_start(member_id),
                                self.members.kept_logprobs(member_id))
            self.carrier.carry_out(
                coordinator.finished(member_id, end.reason, result), step)

    def _settle(self, step: Step) -> None:
        """Ends a step: its ends reported; the records of the requests
        that ended go, but a member's whose call is made anew."""
        self._report_ends(step)
        coordinator = self.coordinator
        for request_id in step.ended:
            if not coordinator.is_member(
                    request_id) or coordinator.is_finished(request_id):
                self.members.drop(request_id)
                if self.splicing is not None:
                    self.splicing.forget(request_id)
