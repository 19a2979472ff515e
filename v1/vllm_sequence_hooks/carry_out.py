# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The lifecycle's actions carried out on V1 requests.

A fork is a new request on its parent's KV blocks, a park and a resume a
streaming session's (`parking.KvParking`), merged tokens and a root's tree
go into its output (`transport`), a call made anew is a new request under
the member's id (`restarts`). What the engine keeps for a member goes into
its record (`members`). An action that ends a member (`Conclude`) records
the end in the step (`step.End`), which the hooks report: carrying out an
action never feeds the coordinator an event.
"""

from dataclasses import dataclass
from typing import Any, Callable, Optional

from vllm_sequence_hooks.member_logprobs import MemberLogprobs
from vllm_sequence_hooks.members import Members
from vllm_sequence_hooks.parking import KvParking
from vllm_sequence_hooks.restarts import (child_params, give_held_output,
                                          member_request, new_call)
from vllm_sequence_hooks.splicing import Splicing
from vllm_sequence_hooks.step import End, Step
from vllm_sequence_hooks.stop_strings import StopStringCheck, cut_at_stop
from vllm_sequence_hooks.transport import append_merged_tokens, attach_tree

from sequence_hooks.actions import (Abort, Action, Conclude, Fork, Park,
                                    ReportTree, Restart, Resume, Splice,
                                    StartTree)
from sequence_hooks.lifecycle import Coordinator
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

# The method that carries out each action.
_CARRIERS = {
    StartTree: "_start_tree",
    Fork: "_fork",
    Park: "_park",
    Resume: "resume",
    Splice: "_splice",
    Conclude: "_conclude",
    Restart: "_restart",
    Abort: "_abort",
    ReportTree: "_report_tree",
}


@dataclass
class ActionCarrier:
    """Carries out the coordinator's actions on one V1 scheduler's requests.

    Args:
        scheduler: The `SequenceHookScheduler`.
        members: The engine's records of its trees' requests.
        parking: The KV mechanics.
        coordinator: The lifecycle, asked only its queries (a member's
            root, whether it is a child, where its own tokens start).
        tokenizer: The model's tokenizer.
        end_requests: Upstream's `finish_requests`.
        critical_path_first: Whether a new child goes ahead of new
            requests.
        restarts: Whether the format makes calls anew (roots then keep
            their request as their calls' template).
        splicing: The splice joins' mechanics, if the format splices.
    """

    scheduler: Any
    members: Members
    parking: KvParking
    coordinator: Coordinator
    tokenizer: Any
    end_requests: Callable[[Any, RequestStatus], Any]
    critical_path_first: bool
    restarts: bool
    splicing: Optional[Splicing]

    def carry_out(self, actions: list[Action], step: Step) -> None:
        """Carries out actions, in order.

        Args:
            actions: The coordinator's actions.
            step: The step they are carried out in.
        """
        for action in actions:
            getattr(self, _CARRIERS[type(action)])(action, step)

    def _start_tree(self, action: StartTree, step: Step) -> None:
        request = self.scheduler.requests[action.root_id]
        # A resume extends the prompt in place; with the engine core in
        # process, the frontend holds the same list.
        request.prompt_token_ids = list(request.prompt_token_ids)
        record = self.members.record(action.root_id)
        if self.restarts:
            record.template = request
            record.holds_output = action.holds_output
        if action.holds_output:
            record.logprobs = MemberLogprobs.of(request)

    def _fork(self, child: Fork, step: Step) -> None:
        scheduler = self.scheduler
        record = self.members.record(child.request_id)
        if child.fresh:
            # A call of its own: nothing of its parent's KV to share.
            root = self.members.get(self.coordinator.root_of(child.request_id))
            request = new_call(root.template, child.request_id,
                               list(child.context_tokens), None,
                               scheduler.max_model_len)
            record.logprobs = MemberLogprobs.of(request)
            scheduler.add_request(request)
            return
        parent = scheduler.requests[child.parent_id]
        context = list(parent.all_token_ids) + list(child.context_tokens)
        request = member_request(
            child.request_id, parent, context,
            child_params(parent, child,
                         scheduler.max_model_len - len(context)))
        record.logprobs = MemberLogprobs.of(request)
        if child.stop:
            record.stop = StopStringCheck(self.tokenizer, request,
                                          len(context))
        if child.position_shift is not None:
            self.splicing.forked(request, parent, child.position_shift)
        record.fork = self.parking.queue_fork(request,
                                              parent,
                                              first=self.critical_path_first)

    def _park(self, action: Park, step: Step) -> None:
        self.parking.park(self.scheduler.requests[action.member_id])

    def resume(self, resume: Resume, step: Step) -> None:
        """Appends a member's merged tokens as its session's next chunk.

        Args:
            resume: The coordinator's action.
            step: This step: a root's output shows its merged tokens.
        """
        member_id, token_ids = resume.member_id, list(resume.token_ids)
        request = self.scheduler.requests[member_id]
        record = self.members.record(member_id)
        if record.logprobs is not None:
            record.logprobs.merged(len(token_ids))
        self.parking.resume(request, token_ids, record.evicted)
        record.evicted = False
        if self.splicing is not None and self.coordinator.is_child(member_id):
            # A path's resume is its closing newline (`splice_join`; with
            # the prefill join also a nested block's join, whose path a
            # hold until its end costs nothing more).
            self.splicing.closing(member_id)
        if token_ids and not self.coordinator.is_child(member_id):
            # The root's stream shows its merged tokens; a child's never
            # leave the engine core.
            append_merged_tokens(step.output_of(request), request, token_ids,
                                 resume.token_logprob)

    def _splice(self, action: Splice, step: Step) -> None:
        """Joins a parked member's paths by their KV (`splicing`); a
        root's stream shows the joined tokens."""
        member_id = action.member_id
        request = self.scheduler.requests[member_id]
        record = self.members.record(member_id)
        token_ids = self.splicing.join(
            request, action, lambda appended, evicted: self.parking.resume(
                request, appended, evicted))
        record.evicted = False
        if record.logprobs is not None:
            record.logprobs.merged(len(token_ids))
        if not self.coordinator.is_child(member_id):
            append_merged_tokens(step.output_of(request), request, token_ids,
                                 action.token_logprob)

    def _conclude(self, action: Conclude, step: Step) -> None:
        """Ends a format's member after its last join: the tokens go to
        its output, uncomputed, and it finishes with the action's reason
        (a root with its tree; a path that splices keeps its blocks for
        its join). A root's stop string among the tokens ends it there,
        as the frontend cuts its output."""
        member_id, token_ids = action.member_id, list(action.token_ids)
        request = self.scheduler.requests[member_id]
        is_child = self.coordinator.is_child(member_id)
        if self.splicing is not None and is_child:
            self.splicing.retain(request, self.coordinator.root_of(member_id))
        start = self.coordinator.own_start(member_id)
        own = [*request.all_token_ids[start:], *token_ids]
        out = step.output_of(request)
        check = None
        if not is_child and request.sampling_params.stop:
            record = self.members.record(member_id)
            if record.stop is None:
                record.stop = StopStringCheck(self.tokenizer, request, start,
                                              len(out.new_token_ids))
            check = record.stop
        append_merged_tokens(out, request, token_ids, action.token_logprob)
        found = None if check is None else check.feed(out.new_token_ids)
        reason = action.finish_reason
        if found is not None:
            cut_at_stop(out, check.num_kept)
            own, reason = list(found.output_token_ids), "stop"
        if reason == "length":
            out.finish_reason = FinishReason.LENGTH
            self.end_requests(member_id, RequestStatus.FINISHED_LENGTH_CAPPED)
        else:
            # A stop string the frontend finds again and reports (as
            # `SequenceHooks._check_stop_string` leaves it to).
            out.finish_reason = (FinishReason.STOP
                                 if found is None else FinishReason.ABORT)
            self.end_requests(member_id, RequestStatus.FINISHED_STOPPED)
        skip = request.sampling_params.skip_special_tokens
        text = (found.output_text if found is not None else
                self.tokenizer.decode(own, skip_special_tokens=skip))
        step.ends.append(End(request, reason, text, own))

    def _restart(self, action: Restart, step: Step) -> None:
        """Ends a member's current call, if running, and makes it anew,
        started once no step of the old call is in flight."""
        member_id = action.member_id
        old = self.scheduler.requests.get(member_id)
        out = step.outputs.get(member_id)
        if out is not None and out.finish_reason is not None:
            # The call upstream finished is not the answer's end: a
            # streaming root's output goes on with the new call.
            out.finish_reason = out.stop_reason = None
        if action.shown_token_ids and old is not None:
            append_merged_tokens(step.output_of(old), old,
                                 list(action.shown_token_ids),
                                 action.token_logprob)
        root = self.members.get(self.coordinator.root_of(member_id))
        request = new_call(root.template, member_id,
                           list(action.prompt_token_ids), action.max_tokens,
                           self.scheduler.max_model_len)
        record = self.members.record(member_id)
        # The new call shares no KV with the old one.
        record.fork, record.evicted = None, False
        record.logprobs = (MemberLogprobs.of(request)
                           if self.coordinator.is_child(member_id)
                           or record.holds_output else None)
        if old is not None and not old.is_finished():
            self.end_requests(member_id, RequestStatus.FINISHED_STOPPED)
        if self.members.in_flight[member_id]:
            record.new_call = request
        else:
            self.scheduler.add_request(request)

    def _abort(self, action: Abort, step: Step) -> None:
        # A member upstream has finished already is skipped: its finish,
        # not reported yet, is void.
        step.ended.update(action.member_ids)
        member_ids = [
            member_id for member_id in action.member_ids
            if not self._engine_finished(member_id)
        ]
        if member_ids:
            self.end_requests(member_ids, RequestStatus.FINISHED_ABORTED)

    def _report_tree(self, action: ReportTree, step: Step) -> None:
        root_id = action.root_id
        out = step.outputs.get(root_id)
        if action.output_token_ids is not None:
            # A held root: its whole output, given now.
            record = self.members.get(root_id)
            out = step.output_of(record.template)
            give_held_output(out, record.template, action.output_token_ids,
                             record.prompt_logprobs, action.tree.finish_reason,
                             action.tree.logprobs)
            record.holds_output = False
        step.ended.add(root_id)
        if self.splicing is not None:
            self.splicing.release_root(root_id)
        if out is not None:
            attach_tree(out, action.tree)

    def _engine_finished(self, member_id: str) -> bool:
        """Whether upstream has finished a member (a call made anew is
        not finished)."""
        record = self.members.get(member_id)
        if record is not None and record.new_call is not None:
            return False
        request = self.scheduler.requests.get(member_id)
        return request is None or request.is_finished()
