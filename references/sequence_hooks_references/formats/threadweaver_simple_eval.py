# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ThreadWeaver's evaluation controller, run as a client of stock vLLM.

The reference is `branching_generate` in facebookresearch/threadweaver,
threadweaver_sft/src/simple_eval.py (``--branching-generate``, the
README's evaluation: OpenAI text completions over SGLang), with
`generate_until_any`, which makes its calls; this is its algorithm,
written anew (docs/formats.md):

- Every call's prompt is the text so far, tokenized anew (no special
  tokens added), sent as token ids; its budget is ``min(max_new_tokens,
  max_context_length - len(prompt) - 1)``, ``max_new_tokens`` the
  script's ``max_context_length - len(first prompt) - 1``. A call left
  no token is not made (a negative budget raises there): the answer is
  the text before it (the threads' calls: the text through
  `</Outlines>`).
- Sequential call, stop string ``</Outlines>``: the server leaves a
  matched stop string out of the text, the controller appends it; an
  EOS is not in the text. SGLang checks a call's budget before its
  stops: a call that sampled its whole budget ended by it, its last
  token's text kept (vLLM, the stand-in here, checks the other way
  round: `_reply` reads its answer as SGLang's). A call that ended by
  its budget ends the answer.
  Otherwise the labels are the regex's matches in the call's text from
  its last ``<Outlines>`` (in all of it without one), repeats kept; none
  ends the answer.
- One thread call per label (a repeated label: as many), each on the
  text and ``"\\n<Thread>\\n{label}:"``, stop string ``</Thread>``; of a
  repeated label's calls the reference keeps the last to finish (here
  the last listed: under greedy decoding they are the same).
- Join: the text, ``"\\n"``, then per label ``"<Thread>\\n{label}:"``
  and its thread's text, with ``"</Thread>"`` appended to one that does
  not end with it. Such a thread ends the answer with the join (no
  ``</Parallel>``); otherwise ``"\\n"`` and the next sequential call.
- No step limit.

The answer is the whole text, the prompt's included, as the reference
returns it. ``max_context_length`` is the window plus one: its calls end
one token short of it.
"""

import re
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from sequence_hooks_references.formats.apr_controller import TextCompletion
from sequence_hooks_references.formats.driver import Calls, drive

OUTLINE_PATTERN = re.compile(r"<Outline>\s*([0-9]+(?:\.[0-9]+)*)\s*:")
OUTLINES, OUTLINES_END, THREAD_END = "<Outlines>", "</Outlines>", "</Thread>"


def outline_numbers(call_text: str) -> list[str]:
    """The labels a call's text gives.

    Args:
        call_text: The text one call returned.

    Returns:
        The regex's matches after its last ``<Outlines>`` (in all of it
        without one), in order, repeats kept.
    """
    start = call_text.rfind(OUTLINES)
    return OUTLINE_PATTERN.findall(call_text if start ==
                                   -1 else call_text[start:])


class TokenTextBackend(Protocol):
    """Decodes token-id prompts on stock vLLM, text out (the completions
    API's ``text``, ``finish_reason`` and ``stop_reason``)."""

    def generate_text(self, prompts: list[list[int]],
                      params: list[dict[str, Any]]) -> list[TextCompletion]:
        """Decodes each prompt with its sampling parameters, at once."""
        ...


@dataclass(frozen=True)
class EvalCall:
    """One call the controller made: its prompt ids, its budget and its
    stop string."""
    prompt_ids: list[int]
    max_tokens: int
    stop: str


@dataclass(frozen=True)
class EvalThread:
    """One thread of a fork: its label, its text as joined (a closure
    added), and its call's ids and finish reason."""
    label: str
    text: str
    token_ids: Optional[list[int]]
    finish_reason: str


@dataclass
class EvalRollout:
    """One answer: the whole text (the prompt's first), its forks and
    calls, and why it ended: "length" (a sequential call ended by its
    budget), "no_label" (a call that gave none: the usual last call, at
    EOS), "thread_not_closed" or "no_room"."""
    text: str = ""
    forks: list[list[EvalThread]] = field(default_factory=list)
    calls: list[EvalCall] = field(default_factory=list)
    ended: str = ""


class SimpleEvalController:
    """`branching_generate` for one tokenizer and its settings.

    Args:
        tokenizer: The model's tokenizer (``encode``).
        max_context_length: The script's ``--max-context-length``.
        max_new_tokens: Each call's budget cap; None: the script's.
    """

    def __init__(self,
                 tokenizer,
                 max_context_length: int,
                 max_new_tokens: Optional[int] = None):
        self.tokenizer = tokenizer
        self.max_context_length = max_context_length
        self.max_new_tokens = max_new_tokens

    def encode(self, text: str) -> list[int]:
        """A prompt's ids, as the reference encodes it."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _call(self, prompt: str, stop: str, cap: int) -> Optional[EvalCall]:
        """A call on ``prompt``; None if it is left no token."""
        ids = self.encode(prompt)
        budget = min(cap, self.max_context_length - len(ids) - 1)
        return EvalCall(ids, budget, stop) if budget >= 1 else None

    @staticmethod
    def _send(out: EvalRollout, calls: list[EvalCall],
              sampling: dict[str, Any]) -> Calls:
        """The calls as a backend takes them, recorded."""
        out.calls += calls
        return [(call.prompt_ids,
                 dict(sampling,
                      max_tokens=call.max_tokens,
                      stop=[call.stop],
                      skip_special_tokens=False)) for call in calls]

    def rollout(
        self, prompt: str, sampling: dict[str, Any]
    ) -> Generator[Calls, list[TextCompletion], EvalRollout]:
        """One answer, as a generator: it yields the calls of a step (one
        sequential, or one per label) and is sent their completions.

        Args:
            prompt: The prompt's text.
            sampling: vLLM sampling parameters for every call.

        Returns:
            The `EvalRollout`, as the generator's return value.
        """
        out = EvalRollout()
        cap = (self.max_new_tokens if self.max_new_tokens is not None else
               self.max_context_length - len(self.encode(prompt)) - 1)
        text = prompt
        while True:
            call = self._call(text, OUTLINES_END, cap)
            if call is None:
                out.ended = "no_room"
                break
            [done] = yield self._send(out, [call], sampling)
            generated, length = self._reply(call, done)
            text += generated
            if length:
                out.ended = "length"
                break
            labels = outline_numbers(generated)
            if not labels:
                out.ended = "no_label"
                break
            calls = [
                self._call(text + f"\n<Thread>\n{label}:", THREAD_END, cap)
                for label in labels
            ]
            if None in calls:
                out.ended = "no_room"
                break
            threads = {}
            completions = yield self._send(out, calls, sampling)
            for label, call, done in zip(labels, calls, completions):
                threads[label] = (self._reply(call, done)[0], done)
            joined, text, closed = self._join(text, labels, threads)
            out.forks.append(joined)
            if not closed:
                out.ended = "thread_not_closed"
                break
            text += "\n"
        out.text = text
        return out

    def _reply(self, call: EvalCall, done: TextCompletion) -> tuple[str, bool]:
        """A call's text as SGLang's server gives it, and whether it ended
        by its budget. SGLang checks a call's budget before its stops: a
        call that sampled its whole budget ended by it, its text keeping
        the EOS or stop string it ended at; otherwise neither is in the
        text, and the controller appends a matched stop string. vLLM
        checks the stops first and leaves both out."""
        text = done.text
        if isinstance(done.stop_reason, str):
            text += done.stop_reason
        if len(done.token_ids) < call.max_tokens:
            return text, done.finish_reason == "length"
        if done.finish_reason == "stop" and not isinstance(
                done.stop_reason, str):
            # The EOS vLLM stopped at and did not detokenize.
            text += self.tokenizer.decode(done.token_ids[-1:])
        return text, True

    @staticmethod
    def _join(text: str, labels: list[str],
              threads: dict) -> tuple[list[EvalThread], str, bool]:
        """The threads' join: each label's thread, the text after, and
        whether every thread ended with ``</Thread>``."""
        joined, closed = [], True
        for i, label in enumerate(labels):
            thread, done = threads[label]
            if not thread.endswith(THREAD_END):
                closed = False
                thread += THREAD_END
            if i == 0:
                text += "\n"
            text += f"<Thread>\n{label}:{thread}"
            joined.append(
                EvalThread(label, thread, done.token_ids, done.finish_reason))
        return joined, text, closed


def run(controller: SimpleEvalController,
        backend: TokenTextBackend,
        prompts: list[str],
        sampling: Optional[dict[str, Any]] = None) -> list[EvalRollout]:
    """Runs every prompt's answer at once, each step's calls of all of
    them in one backend call.

    Args:
        controller: The controller.
        backend: Stock vLLM, or a scripted model.
        prompts: The prompts' texts.
        sampling: vLLM sampling parameters (greedy if None).

    Returns:
        Per prompt, its answer.
    """
    sampling = sampling or {"temperature": 0.0}
    return drive([controller.rollout(p, sampling) for p in prompts],
                 backend.generate_text)
