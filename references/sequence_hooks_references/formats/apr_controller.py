# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""APR's controller: its sub-search calls, run as a client of stock vLLM.

The reference is Parallel-Reasoning/APR, src/eval/eval_apr.py
(`call_search`, `decode_trace`, `generate`): text in, text out; its
algorithm, written anew, is in docs/formats.md. It reads and writes
traces with the references' own grammar (`apr_trace`), no code of the
engine's: the yardstick of the engine's lifecycle must not share its
slips. Sub-searches run as with ``--disable_parallel_inference`` (no
result lost to two identical prompts).
"""

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from sequence_hooks_references.formats import apr_trace
from sequence_hooks_references.formats.driver import Calls, drive, together


@dataclass(frozen=True)
class TextCompletion:
    """One call's text (a matched stop string left out), vLLM's finish
    reason and the stop string or id it matched (None if none); the ids it
    sampled and their logprobs, where the backend gives them."""
    text: str
    finish_reason: str
    stop_reason: Any
    token_ids: Optional[list[int]] = None
    logprobs: Optional[list[float]] = None


@dataclass(frozen=True)
class APRCall:
    """One call the controller made: its text prompt, the ids it sampled
    and their logprobs (as its `TextCompletion`)."""
    prompt: str
    token_ids: Optional[list[int]]
    logprobs: Optional[list[float]]


class TextBackend(Protocol):
    """Decodes text prompts on stock vLLM."""

    def generate_text(self, prompts: list[str],
                      params: list[dict[str, Any]]) -> list[TextCompletion]:
        """Decodes each prompt with its sampling parameters, at once."""
        ...


@dataclass
class APRRollout:
    """One search: the parent's final trace, its answer and its calls."""
    trace: str = ""
    # The final trace's winning path, or None.
    answer: Optional[str] = None
    # Per round of sub-searches: the children's final traces.
    rounds: list[list[str]] = field(default_factory=list)
    # Set if the reference would have given up (its `except` returns None).
    error: str = ""
    calls: list[APRCall] = field(default_factory=list)


class APRController:
    """APR's controller.

    Args:
        bos_token: Prepended to every prompt as text (the reference's
            ``ADD_BOS``), replaced by a space in the traces.
        max_tokens: Every call's ``max_tokens``.
        budget: The children's ``Token Budget`` prefix; None for none.
        avg_sub_call: Split ``budget`` among the children.
    """

    def __init__(self,
                 bos_token: str,
                 max_tokens: int,
                 budget: Optional[int] = None,
                 avg_sub_call: bool = False):
        self.bos_token = bos_token
        self.max_tokens = max_tokens
        self.budget = budget
        self.avg_sub_call = avg_sub_call

    def decode(self, prefix: str, sampling: dict[str, Any],
               out: APRRollout) -> Generator[Calls, list, str]:
        """One trace decoded on from ``prefix`` (`decode_trace`)."""
        while True:
            params = dict(sampling,
                          stop=[apr_trace.STOP],
                          max_tokens=self.max_tokens)
            [done] = yield [(self.bos_token + prefix, params)]
            out.calls.append(
                APRCall(self.bos_token + prefix, done.token_ids,
                        done.logprobs))
            prefix = apr_trace.generated(self.bos_token, prefix, done.text)
            if done.stop_reason != apr_trace.STOP:
                break
            prefix += apr_trace.CALLING
        return apr_trace.decoded(prefix)

    def rollout(self, prefix: str,
                sampling: dict[str, Any]) -> Generator[Calls, list, Any]:
        """One search (`call_search`), as a generator of calls."""
        out = APRRollout()
        trace = yield from self.decode(prefix, sampling, out)
        while apr_trace.calls_sub_searches(trace):
            try:
                prefixes, nodes = apr_trace.sub_search_info(
                    trace, self.budget, self.avg_sub_call)
            except Exception as e:
                # The reference's `call_search` gives up on any error.
                out.error = f"{type(e).__name__}: {e}"
                break
            children = yield from together(
                [self.decode(prefix, sampling, out) for prefix in prefixes])
            out.rounds.append(children)
            results = [apr_trace.search_result(c) for c in children]
            trace = yield from self.decode(
                apr_trace.after_sub_searches(trace, nodes, results), sampling,
                out)
        out.trace = trace
        out.answer = None if out.error else apr_trace.search_result(trace)
        return out


def run_apr(controller: APRController,
            backend: TextBackend,
            prefixes: list[str],
            sampling: Optional[dict[str, Any]] = None) -> list[APRRollout]:
    """Runs every search at once, each step's calls in one backend call."""
    return drive([
        controller.rollout(p, sampling or {"temperature": 0.0})
        for p in prefixes
    ], backend.generate_text)
