# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ThreadWeaver's controller: its fork/join, run as a client of stock vLLM.

The reference is `ParallelBranchingController` in facebookresearch/
threadweaver, threadweaver_rl/verl/experimental/agent_loop/
single_turn_agent_loop.py (a client join over vLLM inside verl); this
is its algorithm, token for token, written anew (docs/formats.md):

- Sequential step: decode with stop ids ``[</Outlines>, eos]``. If
  ``</Outlines>`` is among the new tokens, the labels are the regex's
  matches in the text decoded from the context's last ``<Outlines>``
  (special tokens kept), de-duplicated in order; with a label the next
  step is parallel. EOS or length ends the answer.
- Parallel step: one branch per label, each the whole context plus
  ``"\\n<Thread>\\n{label}:"``, decoded with stop ids ``[</Thread>, eos]``.
  The join appends, per branch in label order, a header (the same for the
  first, ``"<Thread>\\n{label}:"`` for the others) and its tokens, cut at an
  EOS, closed with ``"\\n</Thread>"`` unless it stopped at ``</Thread>``.
  A branch that hit EOS or length (or a spent response budget) closes the
  block and ends the answer, else the context gets ``"\\n"`` and the next
  step is sequential.
- At most 32 steps (sequential and parallel both count); a call's budget
  is the context window left (verl's vLLM server sets ``max_tokens`` to
  ``max_model_len`` minus the prompt).

The controller is a generator of calls, so that one backend call serves
many rollouts at once: `run` drives rollouts through a `Backend`
(offline `LLMBackend`, or `HTTPBackend` over the OpenAI completions API
with token-id prompts and ``return_token_ids``).
"""

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from sequence_hooks_references.formats.driver import Calls, drive
from sequence_hooks_testkit.formats.threadweaver_format import (
    CLOSURE, CONCLUSION_CONTINUATION, CONCLUSION_FINAL, CONTINUATION, FINAL,
    OUTLINES, OUTLINES_END, THREAD_END, first_header, later_header,
    outline_labels)

MAX_ITERATIONS = 32


@dataclass(frozen=True)
class Completion:
    """One call's answer: the sampled ids (a matched stop id last),
    vLLM's finish reason (``"stop"`` or ``"length"``) and, when the call
    asked for ``logprobs``, each sampled token's logprob."""
    token_ids: list[int]
    finish_reason: str
    logprobs: Optional[list[float]] = None


class Backend(Protocol):
    """Decodes token-id prompts on stock vLLM."""
    # The context window: a call's default budget is what it leaves.
    max_model_len: int

    def generate(self, prompts: list[list[int]],
                 params: list[dict[str, Any]]) -> list[Completion]:
        """Decodes each prompt with its sampling parameters, at once."""
        ...


@dataclass(frozen=True)
class Branch:
    """One thread of a parallel step."""
    label: str
    # As sampled, its stop id last if it stopped on one.
    token_ids: list[int]
    finish_reason: str
    # What the join appended for it: header, tokens cut at EOS, closure.
    joined_ids: list[int]
    # Its call's logprobs (`Completion.logprobs`).
    logprobs: Optional[list[float]] = None


@dataclass(frozen=True)
class Fork:
    """A parallel step: where it forked and what it joined."""
    # Response tokens before the first header.
    position: int
    branches: list[Branch]
    # CONTINUATION or FINAL (or their <Conclusion> forms), as token ids.
    suffix_ids: list[int]


@dataclass
class Rollout:
    """One answer: the response, its text and its tree."""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    forks: list[Fork] = field(default_factory=list)
    # Why it ended: "eos", "length", "thread_ended", "max_iterations",
    # "response_length", "max_total_tokens" or "no_tokens".
    ended: str = ""
    # vLLM calls made and the prompt tokens they sent.
    calls: int = 0
    prompt_tokens: int = 0
    # Per token of `token_ids`, the logprob its call sampled it with; None
    # for a token the controller appended (a join) or when the calls did
    # not ask for logprobs.
    logprobs: list[Optional[float]] = field(default_factory=list)


@dataclass
class ThreadWeaverController:
    """ThreadWeaver's controller for one tokenizer and its settings.

    Args:
        tokenizer: The model's tokenizer; its tags must be single tokens.
        no_conclusion: ThreadWeaver's released setting (True): joins end
            with CONTINUATION/FINAL; False opens an empty <Conclusion>.
        response_length: Total response budget (verl's
            ``response_length``); None for no limit.
        max_tokens: Caps each call's budget below the context window
            left (not in the reference, whose server gives the window).
        max_iterations: Steps before it gives up (the reference's 32).
        max_model_len: The context window (verl's ``max_model_len``), if
            below the backend's.
    """

    tokenizer: Any
    no_conclusion: bool = True
    response_length: Optional[int] = None
    max_tokens: Optional[int] = None
    max_iterations: int = MAX_ITERATIONS
    max_model_len: Optional[int] = None

    def __post_init__(self):
        self.outlines_id = self._single(OUTLINES)
        self.outlines_end_id = self._single(OUTLINES_END)
        self.thread_end_id = self._single(THREAD_END)
        self.eos_id = self.tokenizer.eos_token_id
        if self.eos_id is None:
            raise ValueError("the tokenizer has no eos_token_id")

    def _single(self, tag: str) -> int:
        ids = self.encode(tag)
        if len(ids) != 1:
            raise ValueError(f"{tag!r} must be one token; got {ids}")
        return ids[0]

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, as the reference encodes its pieces."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def labels(self, context: list[int]) -> list[str]:
        """The outline labels after the context's last ``<Outlines>``."""
        if self.outlines_id not in context:
            return []
        start = len(context) - 1 - context[::-1].index(self.outlines_id)
        return outline_labels(self.tokenizer.decode(context[start:]))

    def _call(self, prompt: list[int], stop_ids: list[int],
              sampling: dict[str, Any], max_model_len: int):
        params = dict(sampling)
        params["stop_token_ids"] = list(
            dict.fromkeys(list(params.get("stop_token_ids") or []) + stop_ids))
        budget = max_model_len - len(prompt)
        if self.max_tokens is not None:
            budget = min(budget, self.max_tokens)
        if budget < 1:
            raise ValueError(f"a prompt of {len(prompt)} tokens leaves no "
                             f"room in a context of {max_model_len}")
        params["max_tokens"] = budget
        return list(prompt), params

    def rollout(
            self, prompt_ids: list[int], sampling: dict[str, Any],
            max_model_len: int) -> Generator[Calls, list[Completion], Rollout]:
        """One answer, as a generator: it yields the calls of a step (one
        sequential, or one per branch) and is sent their completions.

        Args:
            prompt_ids: The prompt's token ids.
            sampling: vLLM sampling parameters for every call
                (``stop_token_ids`` are merged with the controller's).
            max_model_len: The context window (verl's
                ``max_total_tokens``).

        Returns:
            The `Rollout`, as the generator's return value.
        """
        out = Rollout()
        context = list(prompt_ids)
        labels: list[str] = []
        iteration = 0
        while not out.ended:
            iteration += 1
            out.ended = self._limit(out, context, iteration, max_model_len)
            if out.ended:
                break
            if not labels:
                stop_ids = [self.outlines_end_id, self.eos_id]
                calls = [
                    self._call(context, stop_ids, sampling, max_model_len)
                ]
                done = yield calls
                self._count(out, calls)
                labels = self._sequential(out, context, done[0],
                                          calls[0][1]["stop_token_ids"])
            else:
                calls = [
                    self._call(context + self.encode(first_header(label)),
                               [self.thread_end_id, self.eos_id], sampling,
                               max_model_len) for label in labels
                ]
                done = yield calls
                self._count(out, calls)
                self._join(out, context, labels, done,
                           calls[0][1]["stop_token_ids"])
                labels = []
        if self.response_length is not None:
            del out.token_ids[self.response_length:]
            del out.logprobs[self.response_length:]
        out.text = self.tokenizer.decode(out.token_ids)
        return out

    def _limit(self, out: Rollout, context: list[int], iteration: int,
               max_model_len: int) -> str:
        """Why the loop stops before this step, or ""."""
        if iteration > self.max_iterations:
            return "max_iterations"
        if (self.response_length is not None
                and len(out.token_ids) >= self.response_length):
            return "response_length"
        if len(context) >= max_model_len:
            return "max_total_tokens"
        return ""

    @staticmethod
    def _count(out: Rollout, calls: Calls) -> None:
        out.calls += len(calls)
        out.prompt_tokens += sum(len(prompt) for prompt, _ in calls)

    def _sequential(self, out: Rollout, context: list[int], done: Completion,
                    stop_ids: list[int]) -> list[str]:
        """Appends a sequential step; returns the labels to fork."""
        tokens = list(done.token_ids)
        if not tokens:
            out.ended = "no_tokens"
            return []
        context += tokens
        out.token_ids += tokens
        out.logprobs += done.logprobs or [None] * len(tokens)
        matched = tokens[-1] if tokens[-1] in stop_ids else None
        if done.finish_reason == "length":
            out.ended = "length"
        elif matched == self.eos_id or self.eos_id in tokens:
            out.ended = "eos"
        if out.ended or self.outlines_end_id not in tokens:
            return []
        return list(dict.fromkeys(self.labels(context)))

    def _join(self, out: Rollout, context: list[int], labels: list[str],
              completions: list[Completion], stop_ids: list[int]) -> None:
        """Appends the branches' join and the suffix it calls for."""
        position = len(out.token_ids)
        ended = False
        branches = []
        for i, (label, done) in enumerate(zip(labels, completions)):
            tokens = list(done.token_ids)
            matched = tokens[-1] if tokens and tokens[-1] in stop_ids else None
            ended |= done.finish_reason == "length" or matched == self.eos_id
            kept = tokens
            if self.eos_id in tokens:
                kept = tokens[:tokens.index(self.eos_id)]
                ended = True
            if matched != self.thread_end_id:
                kept = kept + self.encode(CLOSURE)
            header = first_header(label) if i == 0 else later_header(label)
            joined = self.encode(header) + kept
            branches.append(
                Branch(label, tokens, done.finish_reason, joined,
                       done.logprobs))
            context += joined
            out.token_ids += joined
            out.logprobs += [None] * len(joined)
        spent = (self.response_length is not None
                 and len(out.token_ids) >= self.response_length)
        if ended or spent:
            out.ended = "thread_ended" if ended else "response_length"
            suffix = FINAL if self.no_conclusion else CONCLUSION_FINAL
        else:
            suffix = (CONTINUATION
                      if self.no_conclusion else CONCLUSION_CONTINUATION)
        suffix_ids = self.encode(suffix)
        context += suffix_ids
        out.token_ids += suffix_ids
        out.logprobs += [None] * len(suffix_ids)
        out.forks.append(Fork(position, branches, suffix_ids))


def sample_seeds(sampling: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The sampling of each of ``n`` samples, as vLLM's V1 gives its
    parallel samples: sample i is seeded ``seed + i`` (unseeded: as is)."""
    samples = []
    for i in range(n):
        one = dict(sampling)
        if one.get("seed") is not None:
            one["seed"] += i
        samples.append(one)
    return samples


def run(controller: ThreadWeaverController,
        backend: Backend,
        prompts: list[list[int]],
        sampling: Optional[dict[str, Any]] = None,
        n: int = 1) -> list[list[Rollout]]:
    """Runs every prompt's ``n`` rollouts at once, each step's calls of all
    of them in one backend call.

    Args:
        controller: The controller.
        backend: Stock vLLM, offline or over HTTP.
        prompts: The prompts' token ids.
        sampling: vLLM sampling parameters (greedy if None).
        n: Samples per prompt (seeded as `sample_seeds` says).

    Returns:
        Per prompt, its ``n`` rollouts.
    """
    samplings = sample_seeds(sampling or {"temperature": 0.0}, n)
    window = min(controller.max_model_len or backend.max_model_len,
                 backend.max_model_len)
    rollouts = [
        controller.rollout(prompt, one, window) for prompt in prompts
        for one in samplings
    ]
    results = drive(rollouts, backend.generate)
    return [results[k * n:(k + 1) * n] for k in range(len(prompts))]
