# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One step of the V1 hooks (or one abort, one arrival): the outputs they
change, the members' ends the engine finds during it, and the requests
whose records may go at its end.

The engine finds a member's end itself (upstream finished its request, a
stop string found in the engine core, a `Conclude` carried out): each is
recorded here as an `End` and reported to the coordinator by the hooks,
in order, once the actions being carried out are done; carrying out an
action never reports one.
"""

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from vllm_sequence_hooks.stop_strings import frontend_text

from sequence_hooks.actions import MemberResult
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.request import Request


@dataclass(frozen=True)
class End:
    """A member's end, found by the engine, to report as `finished`."""

    request: Request
    # "stop", "length" or upstream's other reasons.
    reason: str
    # Its own text and tokens, if the engine cut them (a stop string) or
    # made them (a `Conclude`); None: its text as the frontend would show
    # it, all it sampled.
    text: Optional[str] = None
    token_ids: Optional[list[int]] = None

    def result(self, tokenizer: Any, start: int,
               logprobs: Optional[list]) -> MemberResult:
        """What the member produced, for its `finished` event.

        Args:
            tokenizer: The model's tokenizer.
            start: Where its current call's own tokens start.
            logprobs: Its kept logprobs; None if it kept none.

        Returns:
            Its result.
        """
        text = self.text
        if text is None:
            text = frontend_text(tokenizer, self.request, start)
        token_ids = self.token_ids
        if token_ids is None:
            token_ids = list(self.request.all_token_ids[start:])
        return MemberResult(token_ids, text, logprobs)


@dataclass
class Step:
    """What the hooks change and find during one step."""

    # The step's outputs by request id.
    outputs: dict[str, EngineCoreOutput] = field(default_factory=dict)
    # Outputs the hooks add (merged tokens of parents that sampled
    # nothing), by client index.
    extra: dict[int, list[EngineCoreOutput]] = field(default_factory=dict)
    # Members' ends not reported yet, in the order found.
    ends: deque[End] = field(default_factory=deque)
    # Requests that ended (an end, an abort, a final output): their
    # records go at the step's end, unless a member's call is made anew.
    ended: set[str] = field(default_factory=set)

    def output_of(self, request: Request) -> EngineCoreOutput:
        """A request's output of this step, added if it sampled nothing.

        Args:
            request: A root (or a held root's request as it arrived).

        Returns:
            Its output.
        """
        out = self.outputs.get(request.request_id)
        if out is None:
            out = EngineCoreOutput(request_id=request.request_id,
                                   new_token_ids=[])
            self.outputs[request.request_id] = out
            self.extra.setdefault(request.client_index, []).append(out)
        return out
