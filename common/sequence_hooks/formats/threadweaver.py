# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ThreadWeaver's format (docs/formats.md): outlines fork threads, joined
as one of ThreadWeaver's two controllers joins them (the option
``controller``).

``"rl"`` (the default), its RL agent loop's `ParallelBranchingController`,
joins at token level: at `</Outlines>` the labels are the regex's matches
in the text decoded from the context's last `<Outlines>` (special tokens
kept), de-duplicated in order; each thread's header is
``"\\n<Thread>\\n{label}:"`` and it stops at `</Thread>` or EOS. The join
appends, per thread in label order, a header (the first thread's own,
``"<Thread>\\n{label}:"`` for the others), its tokens cut before an EOS,
and ``"\\n</Thread>"`` unless it stopped at `</Thread>`; then
``"\\n</Parallel>"`` and the end if a thread hit EOS or its length, else
``"\\n"``. At most 32 steps (16 rounds). With the option
``no_conclusion`` false each suffix opens an empty `<Conclusion>`.

``"simple_eval"``, its evaluation's `branching_generate`, works in text
(`SimpleEvalPolicy`): every call's prompt is the text so far tokenized
anew, the labels are read from the call's own text, repeats kept, a
thread that does not end at `</Thread>` gets ``"</Thread>"`` and ends the
answer there, outlines with no label end it, and there is no step limit
and no `</Parallel>` of the controller's.
"""

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

from pydantic import ConfigDict, model_validator
from pydantic.dataclasses import dataclass as options_dataclass

from sequence_hooks.actions import (MERGED_TOKEN_LOGPROB, Action, Conclude,
                                    RequestParams, Restart)
from sequence_hooks.fork_join import (NEEDS, Branch, BranchResult,
                                      ForkJoinPolicy, Joined, TriggerPolicy)
from sequence_hooks.formats import Format, FormatSetting
from sequence_hooks.lifecycle import Coordinator, FormatPolicy
from sequence_hooks.members import Member

NAME = "threadweaver"
LABEL_PATTERN = re.compile(r"<Outline>\s*([0-9]+(?:\.[0-9]+)*)\s*:")
# The tags the format reads, by role; each must be one token.
TAGS = {
    "outlines": "<Outlines>",
    "trigger": "</Outlines>",
    "thread_end": "</Thread>",
}
CLOSURE = "\n</Thread>"
CONTINUATION, FINAL = "\n", "\n</Parallel>"
CONCLUSION_CONTINUATION = "\n<Conclusion>\n"
CONCLUSION_FINAL = "\n<Conclusion>\n</Conclusion>\n</Parallel>"
MAX_STEPS = 32
# `branching_generate`'s closure of a thread that did not end at
# `</Thread>` (which then ends the answer).
SIMPLE_EVAL_CLOSURE = "</Thread>"
# The option ``controller``: the RL agent loop's, or the evaluation's.
RL, SIMPLE_EVAL = "rl", "simple_eval"


def header_text(label: str, first: bool) -> str:
    """A thread's header, as both controllers write it.

    Args:
        label: The thread's label.
        first: Its prompt's header, and the first thread's in a join;
            else every later thread's in a join.

    Returns:
        The header's text.
    """
    return ("\n<Thread>\n" if first else "<Thread>\n") + f"{label}:"


@dataclass(frozen=True)
class TagIds:
    """ThreadWeaver's tags for one tokenizer, as both controllers' formats
    read them: their ids, and the tokenizer's text codec.

    Args:
        outlines_id: `<Outlines>`.
        trigger_id: `</Outlines>`.
        thread_end_id: `</Thread>`.
        eos_id: The end-of-sequence token.
        encode: Text to ids, no special tokens added (the controller's).
        decode: Ids to text, special tokens kept (the controller's).
    """

    outlines_id: int
    trigger_id: int
    thread_end_id: int
    eos_id: int
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]

    @classmethod
    def resolved(cls, tokenizer: Any, tags: Mapping[str, str],
                 **fields: Any) -> "TagIds":
        """A ``cls`` with its tags resolved by ``tokenizer``.

        Args:
            tokenizer: A Hugging Face tokenizer (`encode`, `decode`,
                `eos_token_id`).
            tags: The tag strings by role (`TAGS`' keys).
            fields: The fields of ``cls`` after `TagIds`' own.

        Returns:
            The ``cls``.

        Raises:
            ValueError: if a tag is not one token, or the tokenizer has no
                EOS token.
        """

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        ids = {}
        for role, tag in tags.items():
            found = encode(tag)
            if len(found) != 1:
                raise ValueError(f"format 'threadweaver': {role} tag {tag!r} "
                                 f"is not one token of the model ({found})")
            ids[role] = found[0]
        if tokenizer.eos_token_id is None:
            raise ValueError("format 'threadweaver': the tokenizer has no "
                             "end-of-sequence token")
        return cls(ids["outlines"], ids["trigger"], ids["thread_end"],
                   tokenizer.eos_token_id, encode, tokenizer.decode, **fields)


@dataclass(frozen=True)
class ThreadWeaverFormat(TagIds):
    """ThreadWeaver's format for one tokenizer, as its RL controller joins
    it (`ForkJoinFormat`): `TagIds`' fields, then its own.

    Args:
        no_conclusion: ThreadWeaver's released setting (True).
        max_steps: The controller's step limit.
    """

    no_conclusion: bool = True
    max_steps: int = MAX_STEPS

    @classmethod
    def for_tokenizer(cls,
                      tokenizer: Any,
                      tags: Mapping[str, str] = TAGS,
                      no_conclusion: bool = True) -> "ThreadWeaverFormat":
        """The format with its tags resolved by ``tokenizer``.

        Args:
            tokenizer: A Hugging Face tokenizer (`encode`, `decode`,
                `eos_token_id`).
            tags: The tag strings by role (`TAGS`' keys).
            no_conclusion: See the class.

        Returns:
            The format.

        Raises:
            ValueError: as `TagIds.resolved`.
        """
        return cls.resolved(tokenizer, tags, no_conclusion=no_conclusion)

    def labels(self, context: Sequence[int]) -> list[str]:
        """The labels after the context's last `<Outlines>`, in order,
        each once (none without `<Outlines>`)."""
        ids = list(context)
        if self.outlines_id not in ids:
            return []
        start = len(ids) - 1 - ids[::-1].index(self.outlines_id)
        text = self.decode(ids[start:])
        return list(dict.fromkeys(LABEL_PATTERN.findall(text)))

    def header(self, label: str, first: bool) -> tuple[int, ...]:
        """A thread's header ids (`header_text`)."""
        return tuple(self.encode(header_text(label, first)))

    def branches(self, context: Sequence[int]) -> list[Branch]:
        """One thread per label, each with its header and stop ids."""
        stops = (self.thread_end_id, self.eos_id)
        return [
            Branch(label, self.header(label, True), stops)
            for label in self.labels(context)
        ]

    def join(self, results: Sequence[BranchResult]) -> Joined:
        """The threads' join and the suffix it calls for."""
        token_ids: list[int] = []
        ended = False
        for i, result in enumerate(results):
            tokens = list(result.token_ids)
            last = tokens[-1] if tokens else None
            ended |= result.finish_reason == "length" or last == self.eos_id
            if self.eos_id in tokens:
                tokens = tokens[:tokens.index(self.eos_id)]
                ended = True
            if not (result.finish_reason == "stop"
                    and last == self.thread_end_id):
                tokens += self.encode(CLOSURE)
            token_ids += [*self.header(result.label, i == 0), *tokens]
        if ended:
            suffix = FINAL if self.no_conclusion else CONCLUSION_FINAL
        else:
            suffix = (CONTINUATION
                      if self.no_conclusion else CONCLUSION_CONTINUATION)
        return Joined(tuple(token_ids + self.encode(suffix)), ended)


@dataclass(frozen=True)
class SimpleEvalFormat(TagIds):
    """ThreadWeaver's format as its evaluation's controller
    (`branching_generate`) reads and joins it: in text, each call's
    prompt the text so far tokenized anew: `TagIds`' fields (`encode`: a
    prompt's text to ids; `decode`: sampled ids to text, as its server
    gives them), then its own.

    Args:
        outlines: The `<Outlines>` tag's text.
    """

    outlines: str

    @classmethod
    def for_tokenizer(cls,
                      tokenizer: Any,
                      tags: Mapping[str, str] = TAGS) -> "SimpleEvalFormat":
        """The format with its tags resolved by ``tokenizer``.

        Args:
            tokenizer: A Hugging Face tokenizer (`encode`, `decode`,
                `eos_token_id`).
            tags: The tag strings by role (`TAGS`' keys).

        Returns:
            The format.

        Raises:
            ValueError: as `TagIds.resolved`.
        """
        return cls.resolved(tokenizer, tags, outlines=tags["outlines"])

    def labels(self, call_text: str) -> list[str]:
        """The labels a call's text gives.

        Args:
            call_text: The text one call sampled.

        Returns:
            The regex's matches from its last `<Outlines>` (in all of it,
            without one), in order, repeats kept.
        """
        return LABEL_PATTERN.findall(
            call_text[max(call_text.rfind(self.outlines), 0):])

    def thread(self, result: BranchResult, budget: int) -> tuple[str, bool]:
        """A thread's text as the controller's server gives it, and
        whether it ended at `</Thread>`. The server checks a call's
        budget before its stops: an EOS it stopped at is not detokenized,
        one sampled as its last allowed token is.

        Args:
            result: The thread.
            budget: Its call's budget, the window included.

        Returns:
            Its text, and whether it ends with `</Thread>`.
        """
        tokens = list(result.token_ids)
        if tokens[-1:] == [self.eos_id] and len(tokens) < budget:
            tokens.pop()
        return self.decode(tokens), tokens[-1:] == [self.thread_end_id]

    def join(self, labels: Sequence[str], results: Sequence[BranchResult],
             budgets: Mapping[str, int]) -> tuple[str, bool]:
        """The text the threads join into after `</Outlines>`, and whether
        the answer ends there (a thread did not end at `</Thread>`).

        Args:
            labels: The outlines' labels as written (a repeated one's
                thread is joined at each of its places).
            results: One thread per label.
            budgets: Each label's thread's budget (`thread`).

        Returns:
            The join's text (no continuation), and whether it is final.
        """
        threads = {
            result.label: self.thread(result, budgets[result.label])
            for result in results
        }
        text, final = "", False
        for i, label in enumerate(labels):
            thread, closed = threads[label]
            final |= not closed
            text += (header_text(label, i == 0) + thread +
                     ("" if closed else SIMPLE_EVAL_CLOSURE))
        return text, final


@dataclass(frozen=True)
class _Call:
    """A root's current call: the text it was sent as its prompt and
    where its sampled ids start."""

    text: str
    start: int


@dataclass(frozen=True)
class _Outlines:
    """A root parked at its outlines: its text through `</Outlines>`, the
    labels its join takes (repeats kept) and each one's thread's budget."""

    text: str
    labels: list[str]
    budgets: dict[str, int]


class SimpleEvalPolicy(TriggerPolicy):
    """The decisions of ThreadWeaver's evaluation controller
    (`branching_generate`), one engine's trees.

    A root that samples `</Outlines>` forks one thread per label its
    call's text gives (a repeated label once), each on its whole context
    with its header, stopping at `</Thread>` or EOS, with the request's
    budget and seed, and is parked; with no label it ends there. Once the
    threads have finished, their text joins the root's: a thread that did
    not end at `</Thread>` ends the answer with the join (`Conclude`);
    otherwise the root's next call (`Restart`) is its text and ``"\\n"``
    tokenized anew, the join shown in its output, the request's budget
    (one call's). A call with no room in the window is not made: the
    answer ends where it would have started. No step limit.

    Args:
        coordinator: The coordinator it decides for (its
            `special_kwargs`' `max_children_per_sequence` caps the
            threads of one fork; a refused label is left out of the join).
        eval_format: The format for the engine's tokenizer.
    """

    def __init__(self, coordinator: Coordinator,
                 eval_format: SimpleEvalFormat) -> None:
        super().__init__(coordinator, eval_format)
        # Per root that has made a call anew, that call.
        self._calls: dict[str, _Call] = {}
        # Per parked root, its outlines.
        self._outlines: dict[str, _Outlines] = {}

    def sampled(self, member_id: str, token_ids: Sequence[int],
                params: Callable[[], RequestParams],
                logprobs: Optional[list]) -> list[Action]:
        """`</Outlines>` forks a root's threads and parks it, or ends it;
        any other token is no event.

        Returns:
            `StartTree` at a request's first `</Outlines>`; then its
            `Fork`s and its `Park`, or its `Conclude` (no label, or no
            room for a thread).
        """
        coordinator, fmt = self.coordinator, self.format
        if token_ids[-1] != fmt.trigger_id or coordinator.is_child(member_id):
            return []
        member, actions = self._root(member_id, params)
        call = self._calls.get(member_id) or _Call(
            fmt.decode(list(token_ids[:member.start])), member.start)
        sampled = fmt.decode(list(token_ids[call.start:]))
        labels = fmt.labels(sampled)
        forked = self._within_limits(member, list(dict.fromkeys(labels)))
        headers = {
            label: tuple(fmt.encode(header_text(label, True)))
            for label in forked
        }
        length = len(token_ids)
        # Each thread's budget: the request's (one call's), in the window.
        request = member.tree.params.max_tokens
        window = coordinator.max_model_len - length
        budgets = {
            label:
            min(window - len(header), window if request is None else request)
            for label, header in headers.items()
        }
        if not forked or min(budgets.values()) < 1:
            # No label: the answer is its text so far. No room for a
            # thread: its call would raise, which ends the answer too.
            return actions + [Conclude(member_id, (), MERGED_TOKEN_LOGPROB)]
        for label in forked:
            actions.append(
                coordinator.fork(member, length, headers[label], member.seed,
                                 request, (fmt.thread_end_id, fmt.eos_id),
                                 label))
        actions.append(coordinator.park(member, length))
        self._outlines[member_id] = _Outlines(
            call.text + sampled,
            [label for label in labels if label in forked], budgets)
        return actions

    def children_done(self, member: Member, length: int) -> list[Action]:
        """The threads' join: the root's end with it, or its next call."""
        coordinator, fmt = self.coordinator, self.format
        root_id = member.node.request_id
        outlines = self._outlines.pop(root_id)
        join, final = fmt.join(outlines.labels, self._results(member),
                               outlines.budgets)
        if not final:
            join += CONTINUATION
        shown = tuple(fmt.encode(join))
        coordinator.record_merged(member, length - member.start, len(shown))
        text = outlines.text + join
        prompt = tuple(fmt.encode(text))
        if final or len(prompt) >= coordinator.max_model_len:
            return [Conclude(root_id, shown, MERGED_TOKEN_LOGPROB)]
        self._calls[root_id] = _Call(text, len(prompt))
        return [Restart(root_id, prompt, shown, MERGED_TOKEN_LOGPROB, None)]

    def forget(self, member: Member) -> None:
        """Drops the tree's call and outlines."""
        root_id = member.tree.state.root.request_id
        self._calls.pop(root_id, None)
        self._outlines.pop(root_id, None)


@options_dataclass(config=ConfigDict(extra="forbid", strict=True))
class ThreadWeaverOptions:
    """ThreadWeaver's options (``format_options``)."""

    controller: Literal["rl", "simple_eval"] = RL
    """Whose fork/join the engine serves: ``"rl"``, the RL agent loop's
    `ParallelBranchingController` (threadweaver_rl), or ``"simple_eval"``,
    the evaluation's `branching_generate` (threadweaver_sft/src/
    simple_eval.py, ``--branching-generate``)."""

    no_conclusion: bool = True
    """The RL controller's ``no_conclusion``: True, its released setting;
    False: each join's suffix opens an empty `<Conclusion>`. The
    evaluation's controller writes no suffix: False is refused there."""

    @model_validator(mode="after")
    def _check(self) -> "ThreadWeaverOptions":
        if self.controller == SIMPLE_EVAL and not self.no_conclusion:
            raise ValueError("format 'threadweaver': no_conclusion is an "
                             "option of controller 'rl'; controller "
                             "'simple_eval' joins with no conclusion")
        return self


def _policy(coordinator: Coordinator, setting: FormatSetting) -> FormatPolicy:
    if setting.options.controller == SIMPLE_EVAL:
        return SimpleEvalPolicy(
            coordinator,
            SimpleEvalFormat.for_tokenizer(setting.tokenizer, setting.tags))
    return ForkJoinPolicy(
        coordinator,
        ThreadWeaverFormat.for_tokenizer(setting.tokenizer, setting.tags,
                                         setting.options.no_conclusion))


# Both controllers' policies ask the same of an engine (`SimpleEvalPolicy`
# forks, parks, stops threads at their ends, concludes and restarts).
FORMAT = Format(name=NAME,
                policy=_policy,
                needs=NEEDS,
                tags=TAGS,
                options=ThreadWeaverOptions,
                summary="outlines fork threads, joined as its RL or its "
                "evaluation controller joins them")
