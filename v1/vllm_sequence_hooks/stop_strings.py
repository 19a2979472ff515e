# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stop strings checked in the engine core, where V1 checks none.

V1 checks stop strings in the frontend, on the outputs it receives. Two
kinds of hooked request need the check in the engine core instead:
- children, whose outputs never reach the frontend: a child honours its
  request's stop strings and ends with "stop", its text cut as V0 cuts it;
- roots whose outputs carry trees: the frontend would find the stop and
  then abort the request in the engine core, so no output would carry the
  tree; found here, the stop ends the request in the same output.

Each check is the frontend's own `IncrementalDetokenizer`, fed the same
tokens the frontend would see; `frontend_text` gives a finished member's
text the same way (as V0's incremental detokenization does), so texts, and
the merges made of them, are the same on both engines.
"""

from types import SimpleNamespace
from typing import Optional

from vllm.v1.engine import EngineCoreOutput, FinishReason
from vllm.v1.engine.detokenizer import IncrementalDetokenizer
from vllm.v1.request import Request, RequestStatus


def frontend_text(tokenizer, request: Request, start: int) -> str:
    """The text the frontend would show for a request's tokens after
    ``start`` of its `all_token_ids`, detokenized in their context.

    Args:
        tokenizer: The model's tokenizer.
        request: The request.
        start: Where its own tokens start.
    """
    params = request.sampling_params.clone()
    # The text of the tokens as they are: any stop was found already.
    params.stop = None
    tokens = request.all_token_ids
    detokenizer = IncrementalDetokenizer.from_new_request(
        tokenizer,
        SimpleNamespace(request_id=request.request_id,
                        prompt_token_ids=list(tokens[:start]),
                        prompt_embeds=None,
                        sampling_params=params))
    detokenizer.update(list(tokens[start:]), False)
    return detokenizer.output_text


class StopStringChecks:
    """Per watched request, the frontend's stop-string check.

    Args:
        tokenizer: The model's tokenizer.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._checks: dict[str, IncrementalDetokenizer] = {}
        # Of the tokens the last `feed` that found a stop was given, how
        # many its check took: the rest follow the stop string.
        self.num_kept = 0
        # Tokens of each watched request's `all_token_ids` fed so far.
        self._fed: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._checks)

    def is_watched(self, request_id: str) -> bool:
        return request_id in self._checks

    def watch(self, request: Request, start: int, num_unfed: int = 0) -> None:
        """Starts checking a request whose own tokens start at ``start`` of
        its `all_token_ids`, fed all of them but the ``num_unfed`` last."""
        tokens = request.all_token_ids
        # What the detokenizer reads of the frontend's `EngineCoreRequest`.
        check = IncrementalDetokenizer.from_new_request(
            self.tokenizer,
            SimpleNamespace(request_id=request.request_id,
                            prompt_token_ids=list(tokens[:start]),
                            prompt_embeds=None,
                            sampling_params=request.sampling_params))
        end = len(tokens) - num_unfed
        check.update(list(tokens[start:end]), False)
        self._checks[request.request_id] = check
        self._fed[request.request_id] = end

    def feed(self, request_id: str,
             token_ids: list[int]) -> Optional[IncrementalDetokenizer]:
        """Feeds a watched request's new output tokens, one at a time, up
        to the one that completes a stop string, if any.

        One at a time: vLLM 0.32's detokenizer drops the tokens fed with
        the one completing a stop string and after it (several arrive at
        once when a merge is appended); 0.31's keeps them. Fed
        singly, the check's tokens end at the stop on every version.

        Returns:
            Its check if they complete a stop string (its text and tokens
            then end there: `num_kept` of ``token_ids``), else None.
        """
        check = self._checks[request_id]
        for num_fed, token_id in enumerate(token_ids, 1):
            self._fed[request_id] += 1
            if check.update([token_id], False) is not None:
                self.num_kept = num_fed
                return check
        return None

    def feed_new(self, request: Request) -> Optional[IncrementalDetokenizer]:
        """Feeds a watched request's tokens added since the last feed
        (sampled and merged alike); see `feed`."""
        new = list(request.all_token_ids[self._fed[request.request_id]:])
        return self.feed(request.request_id, new) if new else None

    def forget(self, request_id: str) -> None:
        self._checks.pop(request_id, None)
        self._fed.pop(request_id, None)


def check_root_stop_strings(hooks, out: EngineCoreOutput, step) -> None:
    """Ends a request whose output completes a stop string, with its
    tree, if its outputs carry trees.

    Args:
        hooks: The scheduler's `SequenceHooks`.
        out: The request's output of this step (not finished).
        step: The hooks' record of this step's outputs.
    """
    request = hooks.scheduler.requests.get(out.request_id)
    if (request is None or request.is_finished()
            or not request.sampling_params.stop):
        return
    coordinator = hooks.coordinator
    if not hooks.stop_strings.is_watched(out.request_id):
        if not (coordinator.is_member(out.request_id)
                or hooks.sample_trees.carries_trees(out.request_id,
                                                    coordinator.is_member)):
            return
        start = (coordinator.own_start(out.request_id)
                 if coordinator.is_member(out.request_id) else
                 request.num_prompt_tokens)
        hooks.stop_strings.watch(request, start, len(out.new_token_ids))
    check = hooks.stop_strings.feed(out.request_id, out.new_token_ids)
    if check is None:
        return
    # The tokens after the stop go, as vLLM 0.32's frontend drops them
    # (`OutputProcessor._trim_surplus_tokens`); 0.31's
    # would keep them in `CompletionOutput.token_ids`.
    kept = hooks.stop_strings.num_kept
    if kept < len(out.new_token_ids):
        del out.new_token_ids[kept:]
        if out.new_logprobs is not None:
            out.new_logprobs = out.new_logprobs.slice_request(0, kept)
    hooks.end_requests(out.request_id, RequestStatus.FINISHED_STOPPED)
    if coordinator.is_member(out.request_id):
        # As on V0: live children are aborted, the root stops there;
        # its tokens end where the frontend cuts them.
        step.outputs[out.request_id] = out
        hooks.finish_member(request, "stop", step, check.output_text,
                            list(check.output_token_ids))
    # The frontend finds the same stop string and reports it; were it
    # not to, the request would end aborted rather than wait forever.
    out.finish_reason = FinishReason.ABORT
