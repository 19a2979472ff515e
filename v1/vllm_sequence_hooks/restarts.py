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
from typing import Any, Optional

from vllm_sequence_hooks.member_logprobs import output_logprob_rows

from sequence_hooks.actions import Fork
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreOutput, FinishReason
from vllm.v1.request import Request


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


def new_call(template: Request, member_id: str, prompt: list[int],
             max_tokens: Optional[int], max_model_len: int) -> Request:
    """A member's call from ``prompt`` (`Restart`, `Fork.fresh`).

    Args:
        template: Its tree's root's request as it arrived, whose
            parameters it has (its seed: every call of a format's
            controller has the request's).
        member_id: The member's id.
        prompt: The call's prompt.
        max_tokens: Its budget; None: the root's (one call's).
        max_model_len: The context window, which caps the budget.

    Returns:
        The call's request.
    """
    params = later_call(template.sampling_params.clone())
    params.max_tokens = min(
        template.max_tokens if max_tokens is None else max_tokens,
        max_model_len - len(prompt))
    return member_request(member_id, template, prompt, params)


def held_prompt_logprobs(out: EngineCoreOutput) -> Optional[tuple[Any, Any]]:
    """What a held root's output carries of its prompt's logprobs
    (upstream gives them whole with the first sampled token).

    Args:
        out: The root's output, held back.

    Returns:
        Its `new_prompt_logprobs_tensors` and `prompt_token_id_logprobs`;
        None if it carries neither.
    """
    if (out.new_prompt_logprobs_tensors is None
            and out.prompt_token_id_logprobs is None):
        return None
    return out.new_prompt_logprobs_tensors, out.prompt_token_id_logprobs


def give_held_output(out: EngineCoreOutput, template: Request,
                     output_token_ids: tuple[int, ...],
                     prompt_logprobs: Optional[tuple[Any, Any]],
                     reason: Optional[str], logprobs: Optional[list]) -> None:
    """A held root's end: ``out`` carries its whole output.

    Args:
        out: Its output of this step.
        template: Its request as it arrived.
        output_token_ids: Its output.
        prompt_logprobs: Its prompt's logprobs, kept from the output that
            carried them (`held_prompt_logprobs`); None: none kept (none
            asked, or the root ends at its first sampled token, whose
            output has them).
        reason: Its finish reason in its tree.
        logprobs: Its tokens' logprobs in its tree.
    """
    out.new_token_ids = list(output_token_ids)
    asked = template.sampling_params.num_logprobs
    out.new_logprobs = None if asked is None else output_logprob_rows(
        out.new_token_ids, logprobs, asked)
    if prompt_logprobs is not None:
        (out.new_prompt_logprobs_tensors,
         out.prompt_token_id_logprobs) = prompt_logprobs
    if out.finish_reason is None:
        out.finish_reason = (FinishReason.LENGTH
                             if reason == "length" else FinishReason.STOP)


class StepsInFlight:
    """Steps in flight per request id (async scheduling, the pipeline's
    batch queue), while the format makes calls anew: upstream applies a
    step's tokens to whatever request holds the id, so a call made anew
    waits until none of the old call's is in flight.

    Counted for every request, tree or not: a request's first trigger may
    restart its call (a seeded fork with no branch) while the step
    scheduled before its tree started is in flight.
    """

    def __init__(self) -> None:
        self._steps: Counter = Counter()

    def __len__(self) -> int:
        """Requests with steps in flight."""
        return len(self._steps)

    def __getitem__(self, request_id: str) -> int:
        """A request's steps in flight."""
        return self._steps[request_id]

    def scheduled(self, scheduler_output: SchedulerOutput) -> None:
        """A step was scheduled: its requests' steps are in flight."""
        self._steps.update(scheduler_output.num_scheduled_tokens)

    def landed(self, scheduler_output: SchedulerOutput) -> None:
        """A step's output is in: its requests' steps are not in flight
        (a request ended meanwhile comes out below 0: dropped too)."""
        self._steps.subtract(scheduler_output.num_scheduled_tokens)
        self._steps = +self._steps

    def forget(self, request_id: str) -> None:
        """A request has ended."""
        self._steps.pop(request_id, None)
