# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An engine with no model, for driving `Coordinator` in tests.

`FakeEngine` carries out the coordinator's actions the simplest way an
engine could: a member is the list of its whole context's token ids, a
fork copies its parent's list, a park marks it, a resume appends. Every
event returns the actions the coordinator gave for it; each is checked
against the engine's state (no fork of a parked member, no abort of a
finished one...) before it is carried out, and kept in `actions`, so a
test can compare what the coordinator asked for with what the contract
says.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from sequence_hooks.actions import (Abort, Action, Fork, MemberResult, Park,
                                    ReportTree, RequestParams, Resume,
                                    StartTree)
from sequence_hooks.formats.promise_sync import PromiseSyncPolicy
from sequence_hooks.lifecycle import Coordinator
from sequence_hooks.special_kwargs import SpecialKwargs
from sequence_hooks.tree import PromiseNode

SYNC, PROMISE, ROLE = 1, 2, 3
HOOK_STRINGS = {SYNC: "<sync>", PROMISE: "<promise>", ROLE: "<child>"}
# Ordinary tokens are characters: id = OFFSET + code point.
OFFSET = 100


class FakeLogprob(NamedTuple):
    """Stands in for vLLM's `Logprob`."""

    logprob: float
    rank: Optional[int] = None


class CharTokenizer:
    """One token per character; hook ids decode to their strings."""

    def encode(self, text: str) -> list[int]:
        # Text spelling a hook token stays characters, as the adapters'
        # `encode` must keep it.
        return [OFFSET + ord(char) for char in text]

    def decode(self, token_ids: list[int], show_hooks: bool) -> str:
        return "".join(
            HOOK_STRINGS.get(token, "") if token < OFFSET else chr(token -
                                                                   OFFSET)
            for token in token_ids if token >= OFFSET or show_hooks)


def piece_ids(text: str, pieces: Sequence[str],
              table: Sequence[str]) -> list[int]:
    """``text``'s ids, read left to right: the first of ``pieces`` that
    starts there is one token, its index in ``table``; any other
    character is ``OFFSET`` plus its code point. (``pieces`` longest
    first makes the longest match win.)"""
    ids, at = [], 0
    while at < len(text):
        piece = next((p for p in pieces if text.startswith(p, at)), None)
        if piece is None:
            ids.append(OFFSET + ord(text[at]))
            at += 1
        else:
            ids.append(table.index(piece))
            at += len(piece)
    return ids


class TagTokenizer:
    """A format's ``tags`` one token each (its index; where two start at
    one place, the longer), every other character one token (`piece_ids`).

    Args:
        tags: The tags, ``eos`` among them.
        eos: The end-of-sequence tag.
    """

    def __init__(self, tags: Sequence[str], eos: str = "<eos>"):
        self.tags = tuple(tags)
        self.longest_first = sorted(self.tags, key=len, reverse=True)
        self.eos_token_id = self.tags.index(eos)

    def encode(self, text: str, **_) -> list[int]:
        return piece_ids(text, self.longest_first, self.tags)

    def decode(self, token_ids: list[int], **_) -> str:
        return "".join(self.tags[t] if t < OFFSET else chr(t - OFFSET)
                       for t in token_ids)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return [self.decode([t]) for t in token_ids]


def special_kwargs(**limits) -> SpecialKwargs:
    """The fake engine's hook configuration with ``limits``."""
    return SpecialKwargs(sync_token_id=SYNC,
                         promise_token_id=PROMISE,
                         child_role_token_id=ROLE,
                         **limits)


def sampled_logprob(token: int, position: int) -> float:
    """The logprob the fake model gives a sampled token."""
    return -((token + position) % 7 + 1) / 8


class CharTexts:
    """The fake engine's text codec (`sequence_hooks.texts.Texts`): a
    member's text leaves hook tokens out."""

    def __init__(self, tokenizer: CharTokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, False)


class Metric(NamedTuple):
    """One exported value, as a metrics reader sees it."""

    value: float


class CountsAsMetrics:
    """The coordinator's counts as `SequenceHookMetrics` exports them:
    each counter and gauge by its attribute's name, ``.value`` its
    number; the blocked-time histogram's ``.value`` its observations."""

    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator
        self.observed = 0

    def __getattr__(self, name: str) -> Metric:
        counts = self.coordinator.counts
        if name == "blocked_time":
            self.observed += len(counts.take_blocked_times())
            return Metric(self.observed)
        return Metric(getattr(counts, name))


@dataclass
class EngineMember:
    """One running sequence as the fake engine holds it."""

    tokens: list[int]
    # Where its own tokens start (the engine's own bookkeeping).
    start: int
    # Per own token, its logprobs entry.
    logprobs: list[dict] = field(default_factory=list)
    parked: bool = False
    # Finished by the engine, its finish not reported yet.
    stopped: Optional[str] = None


class FakeEngine:
    """A model-free engine running promise trees through a coordinator.

    Args:
        limits: `SpecialKwargs` limits.
        max_model_len: The longest sequence.
        reseeds: Whether a resume re-creates the member's random
            generator (`Coordinator.reseeds_on_resume`).
        show_hooks: Whether members' texts show hook token strings (a
            tokenizer where they are not special); False: the engine
            reports no text and the coordinator decodes.
    """

    def __init__(self,
                 limits: Optional[dict] = None,
                 max_model_len: int = 64,
                 reseeds: bool = False,
                 show_hooks: bool = True):
        self.tokenizer = CharTokenizer()
        self.reseeds = reseeds
        self.show_hooks = show_hooks
        # The coordinator's clock: a step is one second.
        self.now = 0.0
        self.coordinator = Coordinator(PromiseSyncPolicy,
                                       special_kwargs(**(limits or {})),
                                       max_model_len,
                                       CharTexts(self.tokenizer),
                                       clock=lambda: self.now,
                                       reseeds_on_resume=reseeds,
                                       hook_token_strings=list(
                                           HOOK_STRINGS.values()))
        self.metrics = CountsAsMetrics(self.coordinator)
        self.members: dict[str, EngineMember] = {}
        self.params: dict[str, RequestParams] = {}
        self.wants_logprobs: dict[str, bool] = {}
        # Each live member's request (root) id.
        self.request_of: dict[str, str] = {}
        # Every action the coordinator returned, in order.
        self.actions: list[Action] = []
        # Per `Abort` carried out, the members it aborted.
        self.aborted: list[list[str]] = []
        # Roots whose request finished with no tree: their own result.
        self.plain_results: dict[str, MemberResult] = {}

    # Driving the engine, as its scheduler would.

    def add_request(self,
                    request_id: str,
                    prompt: list[int],
                    params: RequestParams,
                    logprobs: bool = False) -> None:
        """A new request; ``logprobs``: whether it asks for them."""
        assert request_id not in self.members
        assert params.prompt_len == len(prompt)
        self.members[request_id] = EngineMember(list(prompt), len(prompt))
        self.params[request_id] = params
        self.wants_logprobs[request_id] = logprobs
        self.request_of[request_id] = request_id

    def sample(self, member_id: str, token: int) -> list[Action]:
        """``member_id`` samples ``token``; hook tokens are events."""
        member = self.members[member_id]
        assert not member.parked and member.stopped is None
        member.logprobs.append({
            token:
            FakeLogprob(sampled_logprob(token, len(member.tokens)), 1)
        })
        member.tokens.append(token)
        self.now += 1.0
        return self.carry_out(
            self.coordinator.sampled(
                member_id, member.tokens,
                lambda: self.params[self.request_of[member_id]]))

    def stop(self, member_id: str, reason: str) -> None:
        """The engine finishes a member; its finish is reported later."""
        member = self.members[member_id]
        assert not member.parked and member.stopped is None
        member.stopped = reason

    def report(self, member_id: str) -> list[Action]:
        """Reports a stopped member's finish to the coordinator."""
        member = self.members.pop(member_id)
        request_id = self.request_of.pop(member_id)
        own = member.tokens[member.start:]
        result = MemberResult(
            own,
            self.tokenizer.decode(own, True) if self.show_hooks else None,
            list(member.logprobs) if self.wants_logprobs[request_id] else None)
        if (member_id == request_id
                and not self.coordinator.is_member(member_id)):
            self.plain_results[member_id] = result
        return self.carry_out(
            self.coordinator.finished(member_id, member.stopped, result))

    def abort_request(self, request_id: str) -> list[Action]:
        """A client aborts a request: the engine ends its root."""
        self.members.pop(request_id)
        self.request_of.pop(request_id)
        return self.carry_out(self.coordinator.aborted(request_id))

    def live(self) -> set[str]:
        return set(self.members)

    # The actions, as the coordinator returned them.

    @property
    def forks(self) -> list[Fork]:
        return [a for a in self.actions if isinstance(a, Fork)]

    @property
    def resumes(self) -> list[tuple[str, Resume]]:
        return [(a.member_id, a) for a in self.actions
                if isinstance(a, Resume)]

    @property
    def aborts(self) -> list[list[str]]:
        """The members each `Abort` aborted here (those the engine had
        finished skipped), one list per action that aborted any."""
        return [aborted for aborted in self.aborted if aborted]

    @property
    def reports(self) -> dict[str, PromiseNode]:
        return {
            a.root_id: a.tree
            for a in self.actions if isinstance(a, ReportTree)
        }

    def carry_out(self, actions: list[Action]) -> list[Action]:
        """Checks each action against the engine's state and carries it
        out, in order.

        Returns:
            ``actions``.
        """
        for action in actions:
            self.actions.append(action)
            if isinstance(action, StartTree):
                assert action.root_id in self.members
                assert action.tree.root.request_id == action.root_id
            elif isinstance(action, Fork):
                self._fork(action)
            elif isinstance(action, Park):
                member = self.members[action.member_id]
                assert not member.parked and member.stopped is None
                member.parked = True
            elif isinstance(action, Resume):
                self._resume(action)
            elif isinstance(action, Abort):
                self._abort(action.member_ids)
            else:
                assert isinstance(action, ReportTree)
                assert sum(
                    isinstance(a, ReportTree) and a.root_id == action.root_id
                    for a in self.actions) == 1
        return actions

    def _fork(self, child: Fork) -> None:
        parent = self.members[child.parent_id]
        assert not parent.parked and parent.stopped is None
        assert child.request_id not in self.members
        tokens = parent.tokens + list(child.context_tokens)
        self.members[child.request_id] = EngineMember(tokens, len(tokens))
        self.request_of[child.request_id] = self.request_of[child.parent_id]

    def _resume(self, resume: Resume) -> None:
        member = self.members[resume.member_id]
        assert member.stopped is None
        assert resume.seed is None or self.reseeds
        member.parked = False
        member.tokens += resume.token_ids
        member.logprobs += [{
            token: FakeLogprob(resume.token_logprob)
        } for token in resume.token_ids]

    def _abort(self, member_ids: tuple[str, ...]) -> None:
        aborted = []
        for member_id in member_ids:
            member = self.members[member_id]
            if member.stopped is not None:
                # Finished here already: its report comes, and is void.
                continue
            del self.members[member_id]
            self.request_of.pop(member_id)
            aborted.append(member_id)
        self.aborted.append(aborted)
