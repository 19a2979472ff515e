# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The policy of a format whose model was trained with per-path positions
and a join that reuses the paths' KV (NPR's and Multiverse's layouts,
docs/formats.md): a building block, as `fork_join` is for formats whose
join is appended text.

The layout it serves, for a block whose goal closes at position G: every
path starts at G+1 (it shares that position with the newline after the
goal), sees the context and itself only, and ends with its closing tag
and a newline; what follows the block starts one past the longest path's
closing tag and sees everything. The newline after a path belongs to that
path: a later sibling, running beside it, never sees it (the published
training masks show it to later siblings, which no parallel decoding
can).

`SplicePolicy`:

- a member that samples the format's goal-closing tag forks one path per
  label that the block's goal lists (`SpliceFormat.labels`; repeats kept,
  as both formats' engines keep them; none, or more than `MAX_PATHS`:
  no fork, it decodes on), each with the
  context ``"\\n" + header``, positioned from its header on as its first
  token were the newline's, and parks;
- a path that samples its closing tag gets the newline (computed in its
  own context) and ends at its next token, which is dropped;
- when every path ended so, the parked member's join is a `Splice`: the
  first path's tokens from the goal's closing tag on, then each later
  path's from its header on, then the format's after-tag (the only
  tokens computed); a path that ended otherwise (end of text, its
  budget) ends the answer with the paths' text up to it instead;
- a path forks blocks of its own if the format nests (Multiverse).

With the option ``join: "prefill"`` (`SpliceOptions`) the paths run as
plain children instead, positioned by their length, and the join
appends the same tokens and computes them: the concatenate-and-prefill
approximation a fork/join on stock vLLM makes, served for comparison
only (its models were not trained with it).
"""

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple, Optional

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass as options_dataclass

from sequence_hooks.actions import (MERGED_TOKEN_LOGPROB, Action, Conclude,
                                    MemberResult, RequestParams, Resume,
                                    Splice, SplicedPath, derive_seed)
from sequence_hooks.fork_join import TriggerPolicy
from sequence_hooks.formats import (CONCLUDE, FORK, PARK_RESUME, SPLICE,
                                    Format, FormatSetting)
from sequence_hooks.lifecycle import Coordinator
from sequence_hooks.members import Member
from sequence_hooks.tree import LiveNode

# What `SplicePolicy`'s actions need of an engine.
NEEDS = frozenset({FORK, PARK_RESUME, CONCLUDE, SPLICE})
NEWLINE = "\n"
# A goal with more labels forks none (NPR's engine ends the answer there;
# here the member decodes on, as after a goal with no label).
MAX_PATHS = 5


@dataclass(frozen=True)
class SpliceFormat:
    """A format of that layout, for one tokenizer.

    Args:
        name: The format's name (for its errors).
        goal_open_id: The tag that opens a block's goal; its labels are
            read from the last one on.
        trigger_id: The tag that closes the goal: sampled, it forks.
        path_open: The tag that opens a path (its header's first token).
        path_close_id: The tag that closes a path.
        after: What follows a block's paths (the closing tokens).
        label_pattern: A label, as the goal lists it (group 1).
        nests: Whether a path forks blocks of its own.
        encode: Text to ids, no special tokens added.
        decode: Ids to text, special tokens kept.
    """

    name: str
    goal_open_id: int
    trigger_id: int
    path_open: str
    path_close_id: int
    after: str
    label_pattern: re.Pattern
    nests: bool
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]

    @classmethod
    def for_tokenizer(cls, name: str, tokenizer: Any, tags: dict[str, str],
                      label_pattern: re.Pattern,
                      nests: bool) -> "SpliceFormat":
        """The format with its tags resolved by ``tokenizer``.

        Args:
            name: The format's name.
            tokenizer: A Hugging Face tokenizer.
            tags: The tag strings by role (`SpliceTags`' fields).
            label_pattern: See the class.
            nests: See the class.

        Returns:
            The format.

        Raises:
            ValueError: if a tag, or the newline, is not one token.
        """

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        ids = {}
        for role, tag in {**tags, "newline": NEWLINE}.items():
            found = encode(tag)
            if len(found) != 1:
                raise ValueError(f"format {name!r}: {role} {tag!r} is not "
                                 f"one token of the model ({found})")
            ids[role] = found[0]
        return cls(name, ids["goal_open"], ids["trigger"], tags["path_open"],
                   ids["path_close"], tags["after_open"] + NEWLINE,
                   label_pattern, nests, encode, tokenizer.decode)

    def labels(self, context: Sequence[int]) -> list[str]:
        """The labels the context's last goal lists, in order, repeats
        kept (none without a goal)."""
        ids = list(context)
        if self.goal_open_id not in ids:
            return []
        start = len(ids) - 1 - ids[::-1].index(self.goal_open_id)
        text = self.decode(ids[start:])
        return self.label_pattern.findall(text)

    def header(self, label: str) -> tuple[int, ...]:
        """A path's header: its open tag, a newline and its label."""
        return tuple(self.encode(f"{self.path_open}{NEWLINE}{label}:"))


@dataclass
class _Block:
    """A parked member's open block: where it forked and its paths."""

    # The member's length at the fork (the goal's closing tag last).
    length: int
    # Each path's member id and its context's length, in label order.
    paths: list[tuple[str, int]]


@options_dataclass(config=ConfigDict(extra="forbid", strict=True))
class SpliceOptions:
    """A splicing format's options (``format_options``)."""

    join: Literal["splice", "prefill"] = "splice"
    """``"splice"``: the join reuses the paths' KV at the positions the
    models were trained with. ``"prefill"``: the paths run as plain
    children and the join appends their tokens and computes them (the
    concatenate-and-prefill approximation), to compare against."""


class SplicePolicy(TriggerPolicy):
    """The decisions of a format whose join splices its paths' KV.

    Args:
        coordinator: The coordinator it decides for (its
            `special_kwargs`' limits cap the paths of one block).
        splice_format: The format.
        prefill_join: Whether its join appends the paths' tokens and
            computes them (``join: "prefill"``) instead of splicing.
    """

    def __init__(self,
                 coordinator: Coordinator,
                 splice_format: SpliceFormat,
                 prefill_join: bool = False) -> None:
        super().__init__(coordinator, splice_format)
        self._prefill_join = prefill_join
        (self._newline, ) = splice_format.encode(NEWLINE)
        # Per parked member, its open block.
        self._blocks: dict[str, _Block] = {}
        # Paths given their newline, whose next token ends them.
        self._closing: set[str] = set()

    def sampled(self, member_id: str, token_ids: Sequence[int],
                params: Callable[[], RequestParams],
                logprobs: Optional[list]) -> list[Action]:
        """A goal's closing tag forks its paths and parks the member; a
        path's closing tag gives it its newline; the token after that
        ends it.

        Returns:
            The actions of the event, if it is one.
        """
        coordinator, fmt = self.coordinator, self.format
        sampled = token_ids[-1]
        is_path = coordinator.is_child(member_id)
        if member_id in self._closing:
            return [Conclude(member_id, (), MERGED_TOKEN_LOGPROB)]
        if is_path and sampled == fmt.path_close_id:
            member = coordinator.member(member_id)
            self._closing.add(member_id)
            coordinator.record_merged(member, len(token_ids) - member.start, 1)
            return [
                Resume(member_id, (self._newline, ), MERGED_TOKEN_LOGPROB,
                       None)
            ]
        if sampled != fmt.trigger_id or (is_path and not fmt.nests):
            return []
        return self._fork(member_id, token_ids, params)

    def _fork(self, member_id: str, token_ids: Sequence[int],
              params: Callable[[], RequestParams]) -> list[Action]:
        """The block's paths and the member's park; none (it decodes
        on) without a label or room for a path."""
        coordinator, fmt = self.coordinator, self.format
        member, actions = self._root(member_id, params)
        labels = fmt.labels(token_ids)
        forked = self._within_limits(
            member, labels if len(labels) <= MAX_PATHS else [])
        length = len(token_ids)
        contexts = {
            label: (self._newline, *fmt.header(label))
            for label in forked
        }
        if any(length + len(context) >= coordinator.max_model_len
               for context in contexts.values()):
            forked = []
        if not forked:
            return actions
        block = _Block(length, [])
        for label in forked:
            fork = coordinator.fork(
                member,
                length,
                contexts[label],
                member.seed,
                None,
                label=label,
                position_shift=None if self._prefill_join else (1, -1))
            block.paths.append(
                (fork.request_id, length + len(contexts[label])))
            actions.append(fork)
        actions.append(coordinator.park(member, length))
        self._blocks[member_id] = block
        return actions

    def finished(self, member_id: str, reason: str,
                 result: MemberResult) -> list[Action]:
        """A path's end after its newline drops the token it sampled
        there: it closed, whatever ended it at that token (as the
        published engines ignore an EOS there)."""
        if member_id in self._closing:
            self._closing.discard(member_id)
            logprobs = (None
                        if result.logprobs is None else result.logprobs[:-1])
            result = replace(result,
                             token_ids=result.token_ids[:-1],
                             text=None,
                             logprobs=logprobs)
            reason = "stop"
        return self.coordinator.end(member_id, reason, result)

    def children_done(self, member: Member, length: int) -> list[Action]:
        """The paths' join: a `Splice` if each ended at its closing tag,
        else the answer's end with their text."""
        coordinator, fmt = self.coordinator, self.format
        member_id = member.node.request_id
        block = self._blocks.pop(member_id)
        children = coordinator.take_finished_children(member)
        closed = all(
            child.finish_reason == "stop"
            and child.token_ids[-2:] == [fmt.path_close_id, self._newline]
            for child in children)
        used = length - member.start
        budget = member.tree.params.max_tokens
        if closed:
            paths, appended = [], 0
            for i, (child,
                    (path_id,
                     context_len)) in enumerate(zip(children, block.paths)):
                # The first path brings the goal's closing tag and the
                # newline (computed by each path alike), the others their
                # header on.
                start = length - 1 if i == 0 else length + 1
                end = context_len + len(child.token_ids)
                paths.append(SplicedPath(path_id, start, end, end - 2))
                appended += end - start
            closing = tuple(fmt.encode(fmt.after))
            total = appended - 1 + len(closing)
            fits = (length + total < coordinator.max_model_len
                    and (budget is None or used + total < budget))
            if fits and self._prefill_join:
                return [self._prefill(member, used, children, closing)]
            if fits:
                coordinator.record_merged(member, used, total)
                return [
                    Splice(member_id, tuple(paths), closing,
                           MERGED_TOKEN_LOGPROB)
                ]
        # As one decoding of the paths in turn would end: with the first
        # path that did not close (all closed: the closing tokens after
        # them, where only the budget or the model's length ends it).
        joined = self._joined(children)
        if closed:
            joined += fmt.encode(fmt.after)
        # Sequential decoding would have stopped at the budget or the
        # model's length.
        room = coordinator.max_model_len - length
        if budget is not None:
            room = min(room, budget - used)
        reason = "length" if len(joined) >= room else "stop"
        joined = joined[:max(room, 0)]
        coordinator.record_merged(member, used, len(joined))
        return [
            Conclude(member_id, tuple(joined), MERGED_TOKEN_LOGPROB, reason)
        ]

    def _joined(self, children: list[LiveNode]) -> list[int]:
        """The paths' text as one decoding of them in turn gives it: the
        newline, then each path's header and tokens, up to the first
        path that did not close."""
        fmt = self.format
        joined = [self._newline]
        for child in children:
            joined += [*fmt.header(child.label or ""), *child.token_ids]
            if child.token_ids[-2:] != [fmt.path_close_id, self._newline]:
                break
        return joined

    def _prefill(self, member: Member, used: int, children: list[LiveNode],
                 closing: tuple[int, ...]) -> Resume:
        """The concatenate-and-prefill join: the paths' text, then the
        closing tag, all computed."""
        joined = (*self._joined(children), *closing)
        self.coordinator.record_merged(member, used, len(joined))
        seed = None
        if member.seed is not None and self.coordinator.reseeds_on_resume:
            seed = member.seed = derive_seed(member.seed, f"resume-{used}")
        return Resume(member.node.request_id, joined, MERGED_TOKEN_LOGPROB,
                      seed)

    def forget(self, member: Member) -> None:
        """Drops the tree's open blocks and closing paths."""
        for member_id in member.tree.member_ids:
            self._blocks.pop(member_id, None)
            self._closing.discard(member_id)


class SpliceTags(NamedTuple):
    """A format's tags by role, each one token of its models."""

    goal_open: str
    trigger: str
    path_open: str
    path_close: str
    after_open: str


def splice_format(name: str, tags: SpliceTags, label_pattern: re.Pattern,
                  nests: bool, summary: str) -> Format:
    """A format of this layout, for the registry.

    Args:
        name: Its name.
        tags: Its tags.
        label_pattern: A label, as its goal lists it (group 1).
        nests: Whether its paths fork blocks of their own.
        summary: Its line in the list of formats.

    Returns:
        The format.
    """

    def policy(coordinator: Coordinator,
               setting: FormatSetting) -> SplicePolicy:
        return SplicePolicy(coordinator,
                            SpliceFormat.for_tokenizer(name, setting.tokenizer,
                                                       dict(setting.tags),
                                                       label_pattern, nests),
                            prefill_join=setting.options.join == "prefill")

    return Format(name=name,
                  policy=policy,
                  needs=NEEDS,
                  tags=tags._asdict(),
                  options=SpliceOptions,
                  summary=summary)
