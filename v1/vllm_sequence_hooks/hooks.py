# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The V1 engine's side of the promise/sync lifecycle (or a format's).

`SequenceHooks` turns a step's `EngineCoreOutput`s into the lifecycle's
events and carries out the actions its coordinator
(`sequence_hooks.lifecycle.Coordinator`, its format's policy composed)
returns, on V1 requests: a fork is a new
request on its parent's KV blocks, a park and a resume are a streaming
session's (`parking.KvParking`), merged tokens and a root's tree travel in
its output (`transport`). The scheduler holds it and calls it after
upstream's `update_from_output`; each step's outputs are a local of
`update`, passed to each action.
"""

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from vllm_sequence_hooks.member_logprobs import MemberLogprobs
from vllm_sequence_hooks.restarts import (CallRestarts, child_params,
                                          member_request)
from vllm_sequence_hooks.stop_strings import (StopStringChecks,
                                              check_root_stop_strings,
                                              frontend_text)
from vllm_sequence_hooks.transport import (ChildPreemptions, SampleTrees,
                                           append_merged_tokens, attach_tree)

from sequence_hooks.actions import (Abort, Action, Conclude, Fork,
                                    MemberResult, Park, ReportTree,
                                    RequestParams, Restart, Resume, StartTree)
from sequence_hooks.formats import RESTART, format_named
from sequence_hooks.lifecycle import Coordinator
from sequence_hooks.metrics import SequenceHookMetrics
from sequence_hooks.ordering import CriticalPathOrder
from sequence_hooks.special_kwargs import SpecialKwargs
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus, StreamingUpdate


@dataclass
class _Step:
    """What the hooks change of one step's outputs."""

    # The step's outputs by request id.
    outputs: dict[str, EngineCoreOutput]
    # Outputs the hooks add (merged tokens of parents that sampled
    # nothing), by client index.
    extra: dict[int, list[EngineCoreOutput]] = field(default_factory=dict)


# The method that carries out each action.
_CARRIERS = {
    StartTree: "_start_tree",
    Fork: "_fork",
    Park: "_park",
    Resume: "resume",
    Conclude: "_conclude",
    Restart: "_restart",
    Abort: "_abort",
    ReportTree: "_report_tree",
}


class SequenceHooks:
    """Runs promise/sync trees on one V1 scheduler.

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
        self.sample_trees = SampleTrees()
        self.child_preemptions = ChildPreemptions()
        self.stop_strings = StopStringChecks(tokenizer)
        self.restarts = CallRestarts(
            scheduler, end_requests, RESTART
            in format_named(special_kwargs.format).needs)
        self.member_logprobs = MemberLogprobs()

    # Events.

    def members_scheduled(
            self, scheduler_output: SchedulerOutput) -> dict[str, Request]:
        """Tree members scheduled this step, read before upstream's update
        (finished members leave `requests` there)."""
        coordinator, requests = self.coordinator, self.scheduler.requests
        if not coordinator.num_members():
            return {}
        return {
            request_id: requests[request_id]
            for request_id in scheduler_output.num_scheduled_tokens
            if coordinator.is_member(request_id) and request_id in requests
        }

    def update(self, members: dict[str, Request],
               engine_outputs: dict[int, EngineCoreOutputs]) -> None:
        """Runs the hooks of a step's outputs, in place: the events of the
        sampled tokens, then their actions; children's outputs removed.

        Args:
            members: `members_scheduled` of this step.
            engine_outputs: Upstream's outputs of this step.
        """
        if not (members or len(self.sample_trees)
                or self._sampled_a_fork(engine_outputs)):
            # No tree, no sample of an `n > 1` request, no promise (or
            # format trigger): the stock outputs as they are (the hot path
            # without hooks).
            return
        step = _Step({
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
            # Children never report to the frontend; their preemptions
            # count as their root's.
            for out in outputs.outputs:
                if out.request_id in children:
                    self.child_preemptions.hold(children[out.request_id], out)
            # Nor do held roots before their end.
            outputs.outputs = self.restarts.shown(outputs.outputs, children)
        for client_index, outputs in step.extra.items():
            engine_outputs.setdefault(
                client_index, EngineCoreOutputs()).outputs.extend(outputs)
        for outputs in engine_outputs.values():
            for out in outputs.outputs:
                self.child_preemptions.attach(out)
                if out.finish_reason is None:
                    check_root_stop_strings(self, out, step)
                if out.finish_reason is not None:
                    self.stop_strings.forget(out.request_id)
                    self.sample_trees.finished(out)

    def finishing(self, request_ids: list[str]) -> None:
        """Requests upstream's `finish_requests` ends (an abort from
        outside, whoever asked): an aborted root takes its tree along."""
        for request_id in request_ids:
            self.sample_trees.forget(request_id)
            self.stop_strings.forget(request_id)
            self.child_preemptions.forget(request_id)
            self.restarts.forget(request_id)
            self.member_logprobs.pop(request_id)
            if (self.coordinator.is_member(request_id)
                    and not self.coordinator.is_child(request_id)):
                self._carry_out(self.coordinator.aborted(request_id), None)
                self.scheduler.parking.forget(request_id)

    def added(self, request_id: str) -> None:
        """A new request: notes the samples of `n > 1` requests; an event
        for the coordinator (a format whose trees start at arrival). A
        member's new call (a fresh child, a call made anew) is none."""
        if self.coordinator.is_member(request_id):
            return
        self.sample_trees.added(request_id)
        if not self.coordinator.trees_start_at_arrival:
            return
        request = self.scheduler.requests[request_id]
        self._carry_out(
            self.coordinator.arrived(
                request_id, request.prompt_token_ids,
                RequestParams.of(request.num_prompt_tokens, request.max_tokens,
                                 request.sampling_params)), None)

    def _sampled_a_fork(self, engine_outputs: dict[int,
                                                   EngineCoreOutputs]) -> bool:
        fork = self.coordinator.forking_token_id
        return any(out.new_token_ids and out.new_token_ids[-1] == fork
                   for outputs in engine_outputs.values()
                   for out in outputs.outputs)

    def _on_output(self, request: Request, out: EngineCoreOutput,
                   step: _Step) -> None:
        if out.finish_reason is None and request.is_finished():
            # Aborted earlier in this step, with its finished ancestor.
            return
        request_id = request.request_id
        if self.coordinator.is_finished(request_id):
            return
        self.member_logprobs.sampled(request_id, out.new_logprobs)
        if out.finish_reason is not None:
            if self.coordinator.is_member(request_id):
                self.finish_member(request, str(out.finish_reason), step)
            else:
                # A child whose tree ended earlier in this step.
                self.member_logprobs.pop(request_id)
                self.stop_strings.forget(request_id)
            return
        if not out.new_token_ids:
            return
        if self.coordinator.is_child(request_id) and (
                self.stop_strings.is_watched(request_id)):
            check = self.stop_strings.feed_new(request)
            if check is not None:
                # As V0's stop checker: the child ends, its text cut.
                self.end_requests(request_id, RequestStatus.FINISHED_STOPPED)
                self.finish_member(request, "stop", step, check.output_text)
                return
        params = request.sampling_params
        actions = self.coordinator.sampled(
            request_id, request.all_token_ids, lambda: RequestParams.of(
                request.num_prompt_tokens, request.max_tokens, params),
            self.member_logprobs.current(request_id))
        if actions:
            # Most tokens are no event: no call on the hot path.
            self._carry_out(actions, step)

    def finish_member(self,
                      request: Request,
                      reason: str,
                      step: _Step,
                      text: Optional[str] = None,
                      token_ids: Optional[list[int]] = None) -> None:
        """Records a member's finish with the lifecycle: every member's end
        on V1 (a stop, a length cap, a child's or a root's stop string).

        Args:
            request: The member's request.
            reason: "stop", "length" or upstream's other reasons.
            step: This step's outputs.
            text: Its own text, if a stop string cut it (else detokenized
                as the frontend would).
            token_ids: Its own tokens, if a stop string cut them (else all
                it sampled).
        """
        request_id = request.request_id
        start = self.coordinator.own_start(request_id)
        self.stop_strings.forget(request_id)
        self.scheduler.parking.forget(request_id)
        if text is None:
            text = frontend_text(self.tokenizer, request, start)
        if token_ids is None:
            token_ids = list(request.all_token_ids[start:])
        self._carry_out(
            self.coordinator.finished(
                request_id, reason,
                MemberResult(token_ids, text,
                             self.member_logprobs.pop(request_id))), step)

    # The coordinator's actions, carried out.

    def _carry_out(self, actions: list[Action], step: Optional[_Step]) -> None:
        for action in actions:
            getattr(self, _CARRIERS[type(action)])(action, step)

    def _start_tree(self, action: StartTree, step: Optional[_Step]) -> None:
        request = self.scheduler.requests[action.root_id]
        # A resume extends the prompt in place; with the engine core in
        # process, the frontend holds the same list.
        request.prompt_token_ids = list(request.prompt_token_ids)
        self.restarts.started(action.root_id, action.holds_output)
        if action.holds_output:
            self.member_logprobs.keep(request)

    def _fork(self, child: Fork, step: Optional[_Step]) -> None:
        scheduler = self.scheduler
        if child.fresh:
            # A call of its own: nothing of its parent's KV to share.
            request = self.restarts.call(
                child.request_id, self.coordinator.root_of(child.request_id),
                list(child.context_tokens))
            self.member_logprobs.keep(request)
            scheduler.add_request(request)
            return
        parent = scheduler.requests[child.parent_id]
        context = list(parent.all_token_ids) + list(child.context_tokens)
        request = member_request(
            child.request_id, parent, context,
            child_params(parent, child,
                         scheduler.max_model_len - len(context)))
        self.member_logprobs.keep(request)
        if child.stop:
            self.stop_strings.watch(request, len(context))
        scheduler.parking.queue_fork(
            request, parent, first=self.special_kwargs.critical_path_first)

    def _park(self, action: Park, step: Optional[_Step]) -> None:
        self.scheduler.parking.park(self.scheduler.requests[action.member_id])

    def resume(self, resume: Resume, step: Optional[_Step]) -> None:
        """Appends a member's merged tokens as its session's next chunk.

        Args:
            resume: The coordinator's action.
            step: This step's outputs: a root's show its merged tokens.
        """
        scheduler, member_id = self.scheduler, resume.member_id
        request = scheduler.requests[member_id]
        if request.status == RequestStatus.RUNNING:
            # Only a parked session takes its next chunk.
            scheduler.parking.park(request)
        token_ids = list(resume.token_ids)
        self.member_logprobs.merged(member_id, len(token_ids))
        sync_token = request.all_token_ids[request.num_computed_tokens:]
        # Output so far becomes prompt; the budget keeps counting it.
        max_tokens = (request.max_tokens - request.num_output_tokens -
                      len(token_ids))
        params = request.sampling_params
        params.prompt_logprobs = None
        # The next chunk of the session: `<sync>` (sampled, not computed
        # yet) and the merged tokens. Upstream keeps the computed tokens'
        # KV and drops the uncomputed sampled token, given back here. The
        # model runner keeps the request's generator: a seeded parent goes
        # on with its own stream, replaying nothing.
        scheduler.parking.release.update_request_as_session(
            scheduler, request,
            StreamingUpdate(mm_features=None,
                            prompt_token_ids=sync_token + token_ids,
                            max_tokens=max_tokens,
                            arrival_time=request.arrival_time,
                            sampling_params=params))
        if member_id in scheduler.parking.evicted:
            scheduler.parking.requeue_evicted(request)
        if token_ids and not self.coordinator.is_child(member_id):
            # The root's stream shows its merged tokens; a child's never
            # leave the engine core.
            append_merged_tokens(self._output_of(request, step), request,
                                 token_ids, resume.token_logprob)

    def _conclude(self, action: Conclude, step: Optional[_Step]) -> None:
        """Ends a format's root after its last join: the tokens go to its
        output, uncomputed, and it finishes "stop" with its tree."""
        member_id, token_ids = action.member_id, list(action.token_ids)
        request = self.scheduler.requests[member_id]
        start = self.coordinator.own_start(member_id)
        own = [*request.all_token_ids[start:], *token_ids]
        out = self._output_of(request, step)
        append_merged_tokens(out, request, token_ids, action.token_logprob)
        out.finish_reason = FinishReason.STOP
        self.end_requests(member_id, RequestStatus.FINISHED_STOPPED)
        skip = request.sampling_params.skip_special_tokens
        text = self.tokenizer.decode(own, skip_special_tokens=skip)
        self.finish_member(request, "stop", step, text, own)

    def _restart(self, action: Restart, step: Optional[_Step]) -> None:
        member_id = action.member_id
        old = self.scheduler.requests.get(member_id)
        if action.shown_token_ids and old is not None:
            append_merged_tokens(self._output_of(old, step), old,
                                 list(action.shown_token_ids),
                                 action.token_logprob)
        self.scheduler.parking.forget(member_id)
        request = self.restarts.call(member_id,
                                     self.coordinator.root_of(member_id),
                                     list(action.prompt_token_ids),
                                     action.max_tokens)
        if self.coordinator.is_child(member_id) or member_id in (
                self.restarts.held):  # (Not a root with an output's.)
            self.member_logprobs.keep(request)
        self.restarts.restart(request)

    @staticmethod
    def _output_of(request: Request, step: _Step) -> EngineCoreOutput:
        """A root's output of this step, added if it sampled nothing."""
        out = step.outputs.get(request.request_id)
        if out is None:
            out = EngineCoreOutput(request_id=request.request_id,
                                   new_token_ids=[])
            step.outputs[request.request_id] = out
            step.extra.setdefault(request.client_index, []).append(out)
        return out

    def _abort(self, action: Abort, step: Optional[_Step]) -> None:
        # A member upstream has finished already is skipped: its finish,
        # not reported yet, is void.
        member_ids = [
            member_id for member_id in action.member_ids
            if not self._engine_finished(member_id)
        ]
        if not member_ids:
            return
        for member_id in member_ids:
            self.member_logprobs.pop(member_id)
            self.stop_strings.forget(member_id)
            self.scheduler.parking.forget(member_id)
            self.restarts.forget(member_id)
        self.end_requests(member_ids, RequestStatus.FINISHED_ABORTED)

    def _report_tree(self, action: ReportTree, step: Optional[_Step]) -> None:
        out = step.outputs.get(action.root_id) if step is not None else None
        if action.output_token_ids is not None and step is not None:
            out = self._output_of(self.restarts.template(action.root_id), step)
            self.restarts.release(action.root_id, action.output_token_ids, out,
                                  action.tree.finish_reason,
                                  action.tree.logprobs)
        self.restarts.forget(action.root_id)
        if out is not None:
            attach_tree(out, action.tree)

    def _engine_finished(self, member_id: str) -> bool:
        """Whether upstream has finished a member (a call made anew is
        not finished)."""
        request = self.scheduler.requests.get(member_id)
        return member_id not in self.restarts.pending and (
            request is None or request.is_finished())

    def export_metrics(self) -> None:
        """Exports the lifecycle's counts and the KV cache's usage."""
        self.metrics.export(self.coordinator.counts)
        self.metrics.kv_cache_usage.set(self.scheduler.kv_cache_manager.usage)
