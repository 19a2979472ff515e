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

from vllm.v1.engine import EngineCoreOutput
from vllm.v1.engine.detokenizer import IncrementalDetokenizer
from vllm.v1.request import Request


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


class StopStringCheck:
    """One request's stop-string check: the frontend's own detokenizer,
    fed the request's own tokens as the frontend would see them.

    Args:
        tokenizer: The model's tokenizer.
        request: The request checked.
        start: Where its own tokens start in its `all_token_ids`.
        num_unfed: Its last tokens left for the first `feed`.
    """

    def __init__(self,
                 tokenizer,
                 request: Request,
                 start: int,
                 num_unfed: int = 0) -> None:
        tokens = request.all_token_ids
        # What the detokenizer reads of the frontend's `EngineCoreRequest`.
        self.detokenizer = IncrementalDetokenizer.from_new_request(
            tokenizer,
            SimpleNamespace(request_id=request.request_id,
                            prompt_token_ids=list(tokens[:start]),
                            prompt_embeds=None,
                            sampling_params=request.sampling_params))
        end = len(tokens) - num_unfed
        self.detokenizer.update(list(tokens[start:end]), False)
        # Tokens of the request's `all_token_ids` fed so far.
        self.num_fed = end
        # Of the tokens the last `feed` that found a stop was given, how
        # many the check took: the rest follow the stop string.
        self.num_kept = 0

    def feed(self, token_ids: list[int]) -> Optional[IncrementalDetokenizer]:
        """Feeds the request's new output tokens, one at a time, up to the
        one that completes a stop string, if any.

        One at a time: vLLM 0.32's detokenizer drops the tokens fed with
        the one completing a stop string and after it (several arrive at
        once when a merge is appended); 0.31's keeps them. Fed
        singly, the check's tokens end at the stop on every version.

        Args:
            token_ids: The tokens.

        Returns:
            The detokenizer if they complete a stop string (its text and
            tokens then end there: `num_kept` of ``token_ids``), else None.
        """
        for num_fed, token_id in enumerate(token_ids, 1):
            self.num_fed += 1
            if self.detokenizer.update([token_id], False) is not None:
                self.num_kept = num_fed
                return self.detokenizer
        return None

    def feed_new(self, request: Request) -> Optional[IncrementalDetokenizer]:
        """Feeds the request's tokens added since the last feed (sampled
        and merged alike); see `feed`.

        Args:
            request: The request checked.

        Returns:
            What `feed` returns.
        """
        new = list(request.all_token_ids[self.num_fed:])
        return self.feed(new) if new else None


def cut_at_stop(out: EngineCoreOutput, num_kept: int) -> None:
    """Drops the tokens of an output after the one that completes a stop
    string, as vLLM 0.32's frontend drops them
    (`OutputProcessor._trim_surplus_tokens`); 0.31's would keep them in
    `CompletionOutput.token_ids`.

    Args:
        out: The output.
        num_kept: How many of its new tokens the stop string keeps.
    """
    if num_kept < len(out.new_token_ids):
        del out.new_token_ids[num_kept:]
        if out.new_logprobs is not None:
            out.new_logprobs = out.new_logprobs.slice_request(0, num_kept)
