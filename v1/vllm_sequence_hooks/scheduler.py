# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Promise/sync on vLLM's V1 engine: the scheduler, V1's adapter of the
lifecycle.

Selected with `scheduler_cls` (`--scheduler-cls`) and configured with
`additional_config={"special_kwargs": {...}}` (`config`). Every hook runs
in the engine core, after the stock `update_from_output` has appended and
stop-checked the step's sampled tokens. Every decision is the
engine-neutral `PromiseCoordinator`'s (`sequence_hooks.lifecycle`); this
module turns V1's outputs into its events and carries out its actions on
V1 requests, with the KV mechanics of `parking`, the transport of
`transport` and the stop strings of `stop_strings`. See docs/v1.md.
"""

from collections import deque
from typing import Any, Optional

from vllm_sequence_hooks.config import (REQUEST_CHECK, check_special_kwargs,
                                        names_request_check, refuse_unservable,
                                        special_kwargs_of)
from vllm_sequence_hooks.parking import ParkingScheduler
from vllm_sequence_hooks.seams import check_vllm_version
from vllm_sequence_hooks.stop_strings import StopStringChecks, frontend_text
from vllm_sequence_hooks.transport import (ChildPreemptions, SampleTrees,
                                           append_merged_tokens, attach_tree)

from sequence_hooks.lifecycle import (ChildSpec, MemberResult,
                                      PromiseCoordinator, RequestParams,
                                      Resume, decode_own, encode_merge)
from sequence_hooks.metrics import SequenceHookMetrics
from sequence_hooks.ordering import CriticalPathOrder, Queued
from sequence_hooks.tree import LiveNode, LiveTree
from vllm.config import VllmConfig
from vllm.logprobs import append_logprobs_for_next_position
from vllm.tokenizers import cached_tokenizer_from_config
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus, StreamingUpdate


class SequenceHookScheduler(ParkingScheduler):
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
        super().__init__(vllm_config, *args, **kwargs)
        # Pipeline parallelism needs nothing of its own: V1 has one
        # scheduler, which the engine core's batch queue drives with up to
        # `max_concurrent_batches` batches in flight, as under async
        # scheduling (docs/running-at-scale.md).
        self.tokenizer = cached_tokenizer_from_config(vllm_config.model_config)
        try:
            special_kwargs = check_special_kwargs(
                special_kwargs_of(vllm_config), vllm_config, self.tokenizer)
        except ValueError as e:
            raise ValueError(f"special_kwargs: {e}") from e
        if not names_request_check(vllm_config):
            raise ValueError(
                f"sequence hooks need --logits-processors {REQUEST_CHECK} "
                "(`hooked_engine_args` adds it): it refuses the requests "
                "they cannot serve (structured outputs) before they reach "
                "the engine")
        self.special_kwargs = special_kwargs
        # V0's `vllm:sequence_hook_*` metrics (docs/v1.md: how they reach
        # `/metrics` from the engine core's process).
        self.metrics = SequenceHookMetrics(
            vllm_config.model_config.served_model_name)
        self.coordinator = PromiseCoordinator.for_tokenizer(
            special_kwargs, self, self.max_model_len, self.tokenizer,
            self.metrics)
        # The queues' order before each step (upstream's own heaps order
        # plain requests by priority under that policy).
        self.order = CriticalPathOrder.for_scheduler(
            self.coordinator,
            special_kwargs,
            vllm_config.scheduler_config.policy,
            engine_orders_by_priority=True)
        self.sample_trees = SampleTrees()
        self.child_preemptions = ChildPreemptions()
        self.stop_strings = StopStringChecks(self.tokenizer)
        # Live children's sampled tokens' logprobs (None where merged), if
        # their request asked for logprobs (a root's are its output's).
        self.child_logprobs: dict[str, list] = {}
        # This step's outputs by request id, while hooks run.
        self._outputs: dict[str, EngineCoreOutput] = {}
        # Outputs the hooks add this step (merged tokens of parents that
        # sampled nothing), by client index.
        self._extra: dict[int, list[EngineCoreOutput]] = {}

    # ----------------------------------------------------------- scheduling

    def schedule(self, *args, **kwargs) -> SchedulerOutput:
        if self.order is not None:
            self._order_queues(self.order)
        output = super().schedule(*args, **kwargs)
        self.metrics.kv_cache_usage.set(self.kv_cache_manager.usage)
        return output

    def _order_queues(self, order: CriticalPathOrder) -> None:
        """Hands the running list and the waiting queues to the ordering
        policy both engines share (`sequence_hooks.ordering`), in place.

        V1 schedules its running list front to back, preempts from its
        back when blocks run out (FCFS), then admits the KV-holding and the
        waiting queues front to back. Under the priority policy those two
        are heaps already in the policy's order (priority, then arrival; a
        member's is its root's) and upstream preempts by the same key:
        only the running list is ordered.
        """
        if not order.begin_step(lambda: self.requests):
            return
        self.running[:] = order.running(self.running, queued)
        for queue in self.waiting_queues():
            if isinstance(queue, deque):
                ordered = order.waiting(queue, queued)
                queue.clear()
                queue.extend(ordered)

    # --------------------------------------------------------------- events

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput,
    ) -> dict[int, EngineCoreOutputs]:
        """Runs the stock update, then the hooks of the sampled tokens."""
        coordinator = self.coordinator
        # Finished members leave `self.requests` in the stock update.
        members = {
            request_id: self.requests[request_id]
            for request_id in scheduler_output.num_scheduled_tokens if
            coordinator.is_member(request_id) and request_id in self.requests
        } if coordinator.num_members() else {}
        engine_outputs = super().update_from_output(scheduler_output,
                                                    model_runner_output)
        if not (members or len(self.sample_trees)
                or self._sampled_a_promise(engine_outputs)):
            # No tree, no sample of an `n > 1` request, no promise: the
            # stock outputs as they are (the hot path without hooks).
            return engine_outputs
        self._outputs = {
            out.request_id: out
            for outputs in engine_outputs.values()
            for out in outputs.outputs
        }
        self._extra = {}
        # Decided before the hooks run: a finished root drops its tree.
        children = {
            request_id: self.coordinator.root_of(request_id)
            for request_id in self._outputs
            if self.coordinator.is_child(request_id)
        }
        try:
            for outputs in engine_outputs.values():
                for out in list(outputs.outputs):
                    request = (members.get(out.request_id)
                               or self.requests.get(out.request_id))
                    if request is not None:
                        self._on_output(request, out)
                # Children never report to the frontend; their
                # preemptions count as their root's.
                for out in outputs.outputs:
                    if out.request_id in children:
                        self.child_preemptions.hold(children[out.request_id],
                                                    out)
                outputs.outputs = [
                    out for out in outputs.outputs
                    if out.request_id not in children
                ]
            for client_index, outputs in self._extra.items():
                engine_outputs.setdefault(
                    client_index, EngineCoreOutputs()).outputs.extend(outputs)
            for outputs in engine_outputs.values():
                for out in outputs.outputs:
                    self.child_preemptions.attach(out)
                    if out.finish_reason is None:
                        self._check_root_stop_strings(out)
                    if out.finish_reason is not None:
                        self.stop_strings.forget(out.request_id)
                        self.sample_trees.finished(out)
        finally:
            self._outputs, self._extra = {}, {}
        return engine_outputs

    def _sampled_a_promise(
            self, engine_outputs: dict[int, EngineCoreOutputs]) -> bool:
        promise = self.special_kwargs.promise_token_id
        return any(out.new_token_ids and out.new_token_ids[-1] == promise
                   for outputs in engine_outputs.values()
                   for out in outputs.outputs)

    def _on_output(self, request: Request, out: EngineCoreOutput) -> None:
        if out.finish_reason is None and request.is_finished():
            # Aborted earlier in this step, with its finished ancestor.
            return
        request_id = request.request_id
        if self.coordinator.is_finished(request_id):
            return
        if out.new_logprobs is not None and request_id in self.child_logprobs:
            self._record_logprobs(request_id, out.new_logprobs)
        if out.finish_reason is not None:
            if self.coordinator.is_member(request_id):
                self._finished(request, str(out.finish_reason))
            return
        if not out.new_token_ids:
            return
        if self.coordinator.is_child(request_id) and (
                self.stop_strings.is_watched(request_id)):
            check = self.stop_strings.feed_new(request)
            if check is not None:
                # As V0's stop checker: the child ends, its text cut.
                self._end(request_id, RequestStatus.FINISHED_STOPPED)
                self._finished(request, "stop", check.output_text)
                return
        params = request.sampling_params
        self.coordinator.sampled(
            request_id, out.new_token_ids[-1],
            request.num_tokens, lambda: RequestParams.of(
                request.num_prompt_tokens, request.max_tokens, params))

    def _finished(self,
                  request: Request,
                  reason: str,
                  text: Optional[str] = None,
                  token_ids: Optional[list[int]] = None) -> None:
        """Records a member's finish with the lifecycle: the one path of
        every member's end on V1 (a stop, a length cap, a stop string of a
        child or of a root).

        Args:
            request: The member's request.
            reason: "stop", "length" or upstream's other reasons.
            text: Its own text, if a stop string cut it (else detokenized
                as the frontend would).
            token_ids: Its own tokens, if a stop string cut them (else all
                it sampled).
        """
        request_id = request.request_id
        start = self.coordinator.own_start(request_id)
        self.stop_strings.forget(request_id)
        self.forget_kv_state(request_id)
        if text is None:
            text = frontend_text(self.tokenizer, request, start)
        if token_ids is None:
            token_ids = list(request.all_token_ids[start:])
        self.coordinator.finished(
            request_id, reason,
            MemberResult(token_ids, text,
                         self.child_logprobs.pop(request_id, None)))

    def _record_logprobs(self, request_id: str,
                         new_logprobs: LogprobsLists) -> None:
        """Keeps a child's sampled tokens' logprobs for its tree node."""
        logprobs = self.child_logprobs[request_id]
        token_ids, values, ranks, _ = new_logprobs
        for row_ids, row_logprobs, rank in zip(token_ids, values, ranks):
            append_logprobs_for_next_position(logprobs, row_ids.tolist(),
                                              row_logprobs.tolist(),
                                              [None] * len(row_ids), int(rank),
                                              len(row_ids) - 1)

    def _check_root_stop_strings(self, out: EngineCoreOutput) -> None:
        """Ends a request whose output completes a stop string, with its
        tree, if its outputs carry trees (`stop_strings`)."""
        request = self.requests.get(out.request_id)
        if (request is None or request.is_finished()
                or not request.sampling_params.stop):
            return
        if not self.stop_strings.is_watched(out.request_id):
            if not (self.coordinator.is_member(out.request_id)
                    or self.sample_trees.carries_trees(
                        out.request_id, self.coordinator.is_member)):
                return
            start = (self.coordinator.own_start(out.request_id)
                     if self.coordinator.is_member(out.request_id) else
                     request.num_prompt_tokens)
            self.stop_strings.watch(request, start, len(out.new_token_ids))
        check = self.stop_strings.feed(out.request_id, out.new_token_ids)
        if check is None:
            return
        # The tokens after the stop go, as vLLM 0.32's frontend drops them
        # (`OutputProcessor._trim_surplus_tokens`); 0.31's
        # would keep them in `CompletionOutput.token_ids`.
        kept = self.stop_strings.num_kept
        if kept < len(out.new_token_ids):
            del out.new_token_ids[kept:]
            if out.new_logprobs is not None:
                out.new_logprobs = out.new_logprobs.slice_request(0, kept)
        self._end(out.request_id, RequestStatus.FINISHED_STOPPED)
        if self.coordinator.is_member(out.request_id):
            # As on V0: live children are aborted, the root stops there;
            # its tokens end where the frontend cuts them.
            self._outputs[out.request_id] = out
            self._finished(request, "stop", check.output_text,
                           list(check.output_token_ids))
        # The frontend finds the same stop string and reports it; were it
        # not to, the request would end aborted rather than wait forever.
        out.finish_reason = FinishReason.ABORT

    def finish_requests(self, request_ids: Any,
                        finished_status: RequestStatus) -> list[Request]:
        """Finishes as upstream; an aborted root takes its tree along."""
        if isinstance(request_ids, str):
            request_ids = (request_ids, )
        if request_ids is not None:
            request_ids = list(request_ids)
        for request_id in list(self.requests if request_ids is
                               None else request_ids):
            self.sample_trees.forget(request_id)
            self.stop_strings.forget(request_id)
            self.child_preemptions.forget(request_id)
            if (self.coordinator.is_member(request_id)
                    and not self.coordinator.is_child(request_id)):
                self.coordinator.aborted(request_id)
                self.forget_kv_state(request_id)
        return super().finish_requests(request_ids, finished_status)

    def _end(self, request_ids: Any, status: RequestStatus) -> None:
        """Ends requests the way upstream does, and nothing more: for ends
        the hooks themselves decide (a child's stop string, a root's, the
        coordinator's aborts), which the lifecycle already knows of, so
        `finish_requests`' abort of a root's tree must not run."""
        super().finish_requests(request_ids, status)

    def add_request(self, request: Request) -> None:
        """Adds as upstream; notes the samples of `n > 1` requests."""
        is_new = request.request_id not in self.requests
        super().add_request(request)
        if is_new:
            self.sample_trees.added(request.request_id)

    # ------------------------------------ the coordinator's actions (V1)

    def new_tree(self, root_id: str) -> LiveTree:
        request = self.requests[root_id]
        # A resume extends the prompt in place; with the engine core in
        # process, the frontend holds the same list.
        request.prompt_token_ids = list(request.prompt_token_ids)
        return LiveTree(root=LiveNode(root_id))

    def fork(self, child: ChildSpec) -> None:
        parent = self.requests[child.parent_id]
        context = list(parent.all_token_ids) + list(child.context_tokens)
        params = parent.sampling_params.clone()
        # Its prompt is the parent's context: no prompt logprobs. A new
        # request seeds a new generator, from the child's own seed.
        params.prompt_logprobs = None
        params.max_tokens = (child.max_tokens if child.max_tokens is not None
                             else self.max_model_len - len(context))
        params.min_tokens = child.min_tokens
        params.seed = child.seed
        request = Request(
            request_id=child.request_id,
            prompt_token_ids=context,
            sampling_params=params,
            pooling_params=None,
            client_index=parent.client_index,
            lora_request=parent.lora_request,
            cache_salt=parent.cache_salt,
            # The root's priority and arrival time (the parent's are), as
            # on V0: a tree's work ranks by its request's arrival.
            priority=parent.priority,
            arrival_time=parent.arrival_time,
            block_hasher=parent._block_hasher)
        if params.logprobs is not None:
            self.child_logprobs[child.request_id] = []
        if child.stop:
            self.stop_strings.watch(request, len(context))
        self.queue_fork(request,
                        parent,
                        first=self.special_kwargs.critical_path_first)

    def park(self, member_id: str) -> None:
        super().park(self.requests[member_id])

    def resume(self, member_id: str, resume: Resume) -> bool:
        request = self.requests[member_id]
        if request.status == RequestStatus.RUNNING:
            # Only a parked session takes its next chunk.
            super().park(request)
        token_ids = resume.token_ids
        if member_id in self.child_logprobs:
            self.child_logprobs[member_id] += [None] * len(token_ids)
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
        self.release.update_request_as_session(
            self, request,
            StreamingUpdate(mm_features=None,
                            prompt_token_ids=sync_token + token_ids,
                            max_tokens=max_tokens,
                            arrival_time=request.arrival_time,
                            sampling_params=params))
        if member_id in self.evicted:
            self.requeue_evicted(request)
        if token_ids and not self.coordinator.is_child(member_id):
            # The root's stream shows its merged tokens; a child's never
            # leave the engine core.
            out = self._outputs.get(member_id)
            if out is None:
                out = EngineCoreOutput(request_id=member_id, new_token_ids=[])
                self._outputs[member_id] = out
                self._extra.setdefault(request.client_index, []).append(out)
            append_merged_tokens(out, request, token_ids, resume.token_logprob)
        return False

    def abort(self, member_ids: list[str]) -> None:
        for member_id in member_ids:
            self.child_logprobs.pop(member_id, None)
            self.stop_strings.forget(member_id)
            self.forget_kv_state(member_id)
        self._end(member_ids, RequestStatus.FINISHED_ABORTED)

    def engine_finished(self, member_id: str) -> bool:
        request = self.requests.get(member_id)
        return request is None or request.is_finished()

    def encode(self, member_id: str, text: str) -> list[int]:
        return encode_merge(self.tokenizer, text)

    def decode(self, member_id: str, token_ids: list[int]) -> str:
        # Every finish here comes with its text (`frontend_text`).
        return decode_own(self.tokenizer, token_ids)

    def report_tree(self, root_id: str, tree: LiveTree) -> None:
        out = self._outputs.get(root_id)
        if out is not None:
            attach_tree(out, tree)


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


def queued(request: Request) -> Queued:
    """What the ordering policy reads of a request: a child's priority and
    arrival time are its root's (`SequenceHookScheduler.fork`)."""
    return Queued(request.request_id, request.priority, request.arrival_time)
