# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Members' calls made anew on V1 (`Restart`: a format's call on a
rewritten text, a seeded call after a join; `Fork.fresh`; held outputs),
and the requests the hooks make for members.

A restarted call is a new `Request` under the member's id, from the
re-tokenized prompt the format gives: the old call ends (upstream frees
its blocks, whose full ones stay in the prefix cache for the new prompt
to hit). Steps may be in flight for the old call (async scheduling, the
pipeline's batch queue): upstream would apply their tokens to whatever
request holds the id, so the new call waits until none is in flight.

A root whose outputs are held never reaches the frontend before its
`ReportTree`, which gives its whole output.
"""

from collections import Counter
from collections.abc import Container
from typing import Any, Callable, Optional

from vllm_sequence_hooks.member_logprobs import output_logprob_rows

from sequence_hooks.actions import Fork
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreOutput, FinishReason
from vllm.v1.request import Request, RequestStatus


def member_request(request_id: str, like: Request, prompt: list[int],
                   params: SamplingParams) -> Request:
    """A request the hooks make for a member (a child, a restarted call).

    Args:
        request_id: Its id.
        like: The request whose client, LoRA, cache salt, priority and
            arrival time it has (a tree's work ranks by its request's
            arrival, as on V0).
        prompt: Its prompt.
        params: Its sampling parameters.

    Returns:
        The request.
    """
    return Request(request_id=request_id,
                   prompt_token_ids=prompt,
                   sampling_params=params,
                   pooling_params=None,
                   client_index=like.client_index,
                   lora_request=like.lora_request,
                   cache_salt=like.cache_salt,
                   priority=like.priority,
                   arrival_time=like.arrival_time,
                   block_hasher=like._block_hasher)


def later_call(params: SamplingParams) -> SamplingParams:
    """A request's parameters for a call the hooks make (a child, a call
    made anew), whose prompt is a tree's context, not the request's
    prompt: no prompt logprobs (they are the request's prompt's), nor the
    prefix-cache skip they set (the cache holds that context).

    Args:
        params: A copy of the request's parameters, changed in place.

    Returns:
        ``params``.
    """
    params.prompt_logprobs = None
    params.prompt_logprob_token_ids = None
    params.skip_reading_prefix_cache = False
    return params


def child_params(parent: Request, child: Fork, room: int) -> SamplingParams:
    """A child's sampling parameters (`Fork`) on its parent's context.

    Args:
        parent: Its parent's request.
        child: The coordinator's fork.
        room: The context window left after its context.

    Returns:
        Its parameters: the parent's, with the fork's budget (else the
        window left), minimum, seed and stop ids.
    """
    # Its prompt is the parent's context. A new request seeds a new
    # generator, from the child's own seed.
    params = later_call(parent.sampling_params.clone())
    params.max_tokens = (child.max_tokens
                         if child.max_tokens is not None else room)
    params.min_tokens = child.min_tokens
    params.seed = child.seed
    if child.stop_token_ids:
        # A format's branch ends (kept as its last token, which
        # `check_stop` does for a stop id).
        params.stop_token_ids = list(
            dict.fromkeys(
                [*(params.stop_token_ids or ()), *child.stop_token_ids]))
        params._all_stop_token_ids.update(child.stop_token_ids)
    return params


class CallRestarts:
    """The held roots of one scheduler and their members' new calls.

    Args:
        scheduler: The `SequenceHookScheduler`.
        end_requests: Upstream's `finish_requests`.
        enabled: Whether the format's lifecycle may restart calls (none
            of this runs for promise/sync).
    """

    def __init__(self, scheduler: Any,
                 end_requests: Callable[[Any, RequestStatus],
                                        Any], enabled: bool) -> None:
        self.scheduler = scheduler
        self.end_requests = end_requests
        self.enabled = enabled
        # Per tree's root, its request as it arrived: every call of its
        # tree has its parameters.
        self.templates: dict[str, Request] = {}
        # Roots whose outputs are held back.
        self.held: set[str] = set()
        # Steps in flight per request id. Counted for every request, tree
        # or not: a request's first trigger may restart its call (a seeded
        # fork with no branch) while the step scheduled before
        # its tree started is in flight.
        self.in_flight: Counter = Counter()
        # New calls waiting for their old call's steps in flight.
        self.pending: dict[str, Request] = {}
        # Per held root, its prompt's logprobs (`new_prompt_logprobs_tensors`
        # and `prompt_token_id_logprobs`: upstream gives them whole with the
        # first sampled token, in an output held back).
        self.prompt_logprobs: dict[str, tuple[Any, Any]] = {}

    def started(self, root_id: str, holds_output: bool) -> None:
        """A tree started (`StartTree`): its root's request is its calls'
        template; ``holds_output``: its outputs are held back."""
        if not self.enabled:
            return
        self.templates[root_id] = self.scheduler.requests[root_id]
        if holds_output:
            self.held.add(root_id)

    def call(self,
             member_id: str,
             root_id: str,
             prompt: list[int],
             max_tokens: Optional[int] = None) -> Request:
        """A member's call from ``prompt``: its root's parameters (its
        seed: every call of a format's controller has the request's),
        ``max_tokens`` (None: the root's, one call's budget), within the
        context window."""
        template = self.templates[root_id]
        params = later_call(template.sampling_params.clone())
        params.max_tokens = min(
            template.max_tokens if max_tokens is None else max_tokens,
            self.scheduler.max_model_len - len(prompt))
        return member_request(member_id, template, prompt, params)

    def restart(self, request: Request) -> None:
        """Ends the member's current call, if running, and starts
        ``request`` once no step of the old call is in flight."""
        request_id = request.request_id
        current = self.scheduler.requests.get(request_id)
        if current is not None and not current.is_finished():
            self.end_requests(request_id, RequestStatus.FINISHED_STOPPED)
        if self.in_flight[request_id]:
            self.pending[request_id] = request
        else:
            self.scheduler.add_request(request)

    def scheduled(self, scheduler_output: SchedulerOutput) -> None:
        """A step was scheduled: its requests' steps are in flight."""
        self.in_flight.update(scheduler_output.num_scheduled_tokens)

    def updated(self, scheduler_output: SchedulerOutput) -> None:
        """A step's output is in: its requests' steps are not in flight;
        new calls that waited for them start."""
        self.in_flight.subtract(scheduler_output.num_scheduled_tokens)
        self.in_flight = +self.in_flight
        for request_id in [r for r in self.pending if not self.in_flight[r]]:
            self.scheduler.add_request(self.pending.pop(request_id))

    def shown(self, outputs: list[EngineCoreOutput],
              children: Container[str]) -> list[EngineCoreOutput]:
        """A step's outputs the frontend gets: none of ``children``, none
        of a held root (what it carries of its prompt is kept).

        Args:
            outputs: The step's outputs of one client.
            children: The ids of children.

        Returns:
            The outputs shown.
        """
        shown = []
        for out in outputs:
            if out.request_id in self.held:
                if (out.new_prompt_logprobs_tensors is not None
                        or out.prompt_token_id_logprobs is not None):
                    self.prompt_logprobs[out.request_id] = (
                        out.new_prompt_logprobs_tensors,
                        out.prompt_token_id_logprobs)
            elif out.request_id not in children:
                shown.append(out)
        return shown

    def release(self, root_id: str, output_token_ids: tuple[int, ...],
                out: EngineCoreOutput, reason: Optional[str],
                logprobs: Optional[list]) -> None:
        """A held root's end: ``out`` carries its whole output.

        Args:
            root_id: The root.
            output_token_ids: Its output.
            out: Its output of this step.
            reason: Its finish reason in its tree.
            logprobs: Its tokens' logprobs in its tree.
        """
        out.new_token_ids = list(output_token_ids)
        asked = self.templates[root_id].sampling_params.num_logprobs
        out.new_logprobs = None if asked is None else output_logprob_rows(
            out.new_token_ids, logprobs, asked)
        kept = self.prompt_logprobs.get(root_id)
        if kept is not None:
            # (None kept: none asked, or the root ends at its first sampled
            # token, whose output has them.)
            (out.new_prompt_logprobs_tensors,
             out.prompt_token_id_logprobs) = kept
        if out.finish_reason is None:
            out.finish_reason = (FinishReason.LENGTH
                                 if reason == "length" else FinishReason.STOP)
        self.forget(root_id)

    def between_calls(self) -> list[Request]:
        """The trees' roots with no request in the scheduler (their
        sub-searches running, or a new call waiting for the old one's
        steps in flight), as they arrived."""
        return [
            template for root_id, template in self.templates.items()
            if root_id not in self.scheduler.requests
        ]

    def template(self, root_id: str) -> Request:
        """A tree's root's request as it arrived."""
        return self.templates[root_id]

    def forget(self, member_id: str) -> None:
        """Drops a finished or aborted member's records."""
        self.templates.pop(member_id, None)
        self.held.discard(member_id)
        self.pending.pop(member_id, None)
        self.prompt_logprobs.pop(member_id, None)
