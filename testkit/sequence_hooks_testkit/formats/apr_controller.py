# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""APR's controller: its sub-search calls, run as a client of stock vLLM.

The reference is Parallel-Reasoning/APR, src/eval/eval_apr.py
(`call_search`, `decode_trace`, `generate`): text in, text out; its
algorithm, written anew, is in docs/formats.md. The trace grammar it
reads (parallel_infernce_utils.py) is `sequence_hooks.apr`, which the
engine's lifecycle reads too.
"""

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from sequence_hooks.apr import (CALLING, MALFORMED, SUB_SEARCHES, call_trace,
                                calls_sub_searches, child_budget, ended_trace,
                                joined_trace, search_result, sub_searches)
from sequence_hooks_testkit.formats.driver import Calls, drive, together


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
                          stop=[SUB_SEARCHES],
                          max_tokens=self.max_tokens)
            [done] = yield [(self.bos_token + prefix, params)]
            out.calls.append(
                APRCall(self.bos_token + prefix, done.token_ids,
                        done.logprobs))
            prefix = call_trace(self.bos_token, prefix, done.text)
            if done.stop_reason != SUB_SEARCHES:
                break
            prefix += CALLING
        return ended_trace(prefix)

    def rollout(self, prefix: str,
                sampling: dict[str, Any]) -> Generator[Calls, list, Any]:
        """One search (`call_search`), as a generator of calls."""
        out = APRRollout()
        trace = yield from self.decode(prefix, sampling, out)
        while calls_sub_searches(trace):
            try:
                nodes = sub_searches(trace)
            except MALFORMED as e:
                out.error = f"{type(e).__name__}: {e}"
                break
            budget = child_budget(self.budget, len(nodes), self.avg_sub_call)
            children = yield from together([
                self.decode(node.prefix(budget), sampling, out)
                for node in nodes
            ])
            out.rounds.append(children)
            trace = yield from self.decode(
                joined_trace(trace, nodes,
                             [search_result(c) for c in children]), sampling,
                out)
        out.trace = trace
        out.answer = None if out.error else search_result(trace)
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
