# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ThreadWeaver's format (docs/formats.md): outlines fork threads, and the
threads' join is a template at token level, as its controller
(`ParallelBranchingController`) builds it.

At `</Outlines>` the labels are the regex's matches in the text decoded
from the context's last `<Outlines>` (special tokens kept), de-duplicated
in order; each thread's header is ``"\\n<Thread>\\n{label}:"`` and it stops
at `</Thread>` or EOS. The join appends, per thread in label order, a
header (the first thread's own, ``"<Thread>\\n{label}:"`` for the others),
its tokens cut before an EOS, and ``"\\n</Thread>"`` unless it stopped at
`</Thread>`; then ``"\\n</Parallel>"`` and the end if a thread hit EOS or
its length, else ``"\\n"``. At most 32 steps (16 rounds). With
the option ``no_conclusion`` false each suffix opens an empty
`<Conclusion>`.
"""

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass as options_dataclass

from sequence_hooks.fork_join import (NEEDS, Branch, BranchResult,
                                      ForkJoinPolicy, Joined)
from sequence_hooks.formats import Format, FormatSetting
from sequence_hooks.lifecycle import Coordinator

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


@dataclass(frozen=True)
class ThreadWeaverFormat:
    """ThreadWeaver's format for one tokenizer (`ForkJoinFormat`).

    Args:
        outlines_id: `<Outlines>`.
        trigger_id: `</Outlines>`.
        thread_end_id: `</Thread>`.
        eos_id: The end-of-sequence token.
        encode: Text to ids, no special tokens added (the controller's).
        decode: Ids to text, special tokens kept (the controller's).
        no_conclusion: ThreadWeaver's released setting (True).
        max_steps: The controller's step limit.
    """

    outlines_id: int
    trigger_id: int
    thread_end_id: int
    eos_id: int
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
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
                   tokenizer.eos_token_id, encode, tokenizer.decode,
                   no_conclusion)

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
        """A thread's header: its prompt's and the first in the join, or
        every later one's in the join."""
        return tuple(
            self.encode(("\n<Thread>\n" if first else "<Thread>\n") +
                        f"{label}:"))

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


@options_dataclass(config=ConfigDict(extra="forbid", strict=True))
class ThreadWeaverOptions:
    """ThreadWeaver's options (``format_options``)."""

    no_conclusion: bool = True
    """Its controller's ``no_conclusion``: True, its released setting;
    False: each join's suffix opens an empty `<Conclusion>`."""


def _policy(coordinator: Coordinator,
            setting: FormatSetting) -> ForkJoinPolicy:
    return ForkJoinPolicy(
        coordinator,
        ThreadWeaverFormat.for_tokenizer(setting.tokenizer, setting.tags,
                                         setting.options.no_conclusion))


FORMAT = Format(name=NAME,
                policy=_policy,
                needs=NEEDS,
                tags=TAGS,
                options=ThreadWeaverOptions,
                summary="outlines fork threads, joined by its controller's "
                "template")
