# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An engine with a scripted model, for running a format's trees on token
lists: the in-engine side of the model-free tests of ThreadWeaver's
format against its controllers (test_threadweaver.py, with its RL
controller's policy; test_threadweaver_simple_eval.py, with its
evaluation controller's).

`CallEngine` decodes the live members greedily in lockstep, one token
each a step, and ends a call as vLLM's stop checks do; it carries out the
coordinator's actions (a fork starts a call on its parent's ids and its
header, a park waits, a resume appends, a restart makes a member's next
call from a new prompt, a conclude ends it), checking each against its
state. A format's test adds the checks of its own policy
(`CallEngine.carry_out`).
"""

from dataclasses import dataclass, field
from typing import Any, Optional

from sequence_hooks.actions import (Action, Conclude, Fork, MemberResult, Park,
                                    ReportTree, RequestParams, Restart, Resume,
                                    StartTree)
from sequence_hooks.lifecycle import Coordinator
from sequence_hooks.special_kwargs import SpecialKwargs

ROOT = "root"


@dataclass
class Call:
    """A member's call as `CallEngine` runs it: its ids, where its own
    start, its budget, its stop ids and its state."""

    tokens: list[int]
    start: int
    budget: int
    stop_ids: tuple[int, ...] = ()
    parked: bool = False
    stopped: Optional[str] = None


@dataclass
class CallEngine:
    """Runs one request (``"root"``) through a coordinator of
    ``special_kwargs``' format, one token per live member a step, with
    vLLM's stop checks (EOS or a stop id: "stop"; the call's budget or
    the window: "length"; no event for a token that ends its member).
    Records every call (its prompt and budget), every action, and the
    root's output as a client sees it (sampled tokens, and the tokens a
    resume or a conclusion appends or a restart shows).

    Args:
        model: ``next_token(context)``: the scripted model's greedy
            choice after a call's ids.
        tokenizer: The coordinator's (``encode``, ``decode``,
            ``eos_token_id``).
        special_kwargs: The format and its limits.
        window: The model length.
        max_tokens: The request's budget as the coordinator is given it
            (None: none, each call's budget the window's).
        seed: The request's seed.
        stop_token_ids: The request's own stop ids: every call of it
            stops there, as vLLM merges them with a child's own.
    """

    model: Any
    tokenizer: Any
    special_kwargs: SpecialKwargs
    window: int
    max_tokens: Optional[int]
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = ()
    # Every call, its prompt and budget.
    calls: list[tuple[list[int], int]] = field(default_factory=list,
                                               init=False)
    actions: list[Action] = field(default_factory=list, init=False)
    output: list[int] = field(default_factory=list, init=False)
    # Whether the root's last call stopped at an EOS before its budget's
    # last token.
    stopped_at_eos: bool = field(default=False, init=False)

    def __post_init__(self):
        self.coordinator = Coordinator.for_format(self.special_kwargs,
                                                  self.window,
                                                  self.tokenizer,
                                                  clock=lambda: 0.0)
        # The live members' current calls.
        self.members: dict[str, Call] = {}

    def run(self, prompt: list[int]) -> list[int]:
        """Decodes the request to its end.

        Returns:
            The root's output.
        """
        self.prompt = list(prompt)
        eos = self.tokenizer.eos_token_id
        params = RequestParams(len(prompt),
                               self.max_tokens,
                               seed=self.seed,
                               stop_token_ids=self.stop_token_ids,
                               eos_token_id=eos)
        self.start(ROOT, list(prompt), self.max_tokens)
        if self.coordinator.trees_start_at_arrival:
            self.carry_out(self.coordinator.arrived(ROOT, list(prompt),
                                                    params))
        while any(not m.parked for m in self.members.values()):
            for member_id in list(self.members):
                member = self.members.get(member_id)
                if member is None or member.parked or member.stopped:
                    continue
                token = self.model.next_token(member.tokens)
                member.tokens.append(token)
                if member_id == ROOT:
                    self.output.append(token)
                own = len(member.tokens) - member.start
                if token == eos or token in member.stop_ids:
                    member.stopped = "stop"
                    self.stopped_at_eos = (member_id == ROOT and token == eos
                                           and own < member.budget)
                elif own >= member.budget:
                    member.stopped = "length"
                else:
                    self.carry_out(
                        self.coordinator.sampled(member_id, member.tokens,
                                                 lambda: params))
            for member_id in [
                    m for m, member in self.members.items() if member.stopped
            ]:
                member = self.members.pop(member_id)
                if self.coordinator.is_member(member_id):
                    own = member.tokens[self.coordinator.own_start(member_id):]
                    self.carry_out(
                        self.coordinator.finished(
                            member_id, member.stopped,
                            MemberResult(own, self.tokenizer.decode(own))))
        assert not self.members
        return self.output

    def start(self,
              member_id: str,
              prompt: list[int],
              budget: Optional[int],
              stop_ids: tuple[int, ...] = ()) -> None:
        """A call of ``member_id``'s: ``budget`` tokens at most, in the
        window (None: to the window)."""
        left = self.window - len(prompt)
        budget = left if budget is None else min(budget, left)
        self.calls.append((list(prompt), budget))
        self.members[member_id] = Call(list(prompt), len(prompt), budget,
                                       (*stop_ids, *self.stop_token_ids))

    def carry_out(self, actions: list[Action]) -> None:
        """Checks each action against the engine's state and carries it
        out, in order."""
        for action in actions:
            self.actions.append(action)
            if isinstance(action, Fork):
                parent = self.members[action.parent_id]
                assert not action.fresh and not parent.parked
                assert action.seed == self.seed
                self.start(action.request_id,
                           parent.tokens + list(action.context_tokens),
                           action.max_tokens, action.stop_token_ids)
            elif isinstance(action, Park):
                self.members[action.member_id].parked = True
            elif isinstance(action, Resume):
                member = self.members[action.member_id]
                assert member.parked and action.seed == self.seed
                member.parked = False
                member.tokens += action.token_ids
                self.output += action.token_ids
            elif isinstance(action, Restart):
                # A new call: its budget the one left, else the request's.
                budget = action.max_tokens
                self.output += action.shown_token_ids
                self.start(action.member_id, list(action.prompt_token_ids),
                           self.max_tokens if budget is None else budget)
            elif isinstance(action, Conclude):
                member = self.members[action.member_id]
                member.tokens += action.token_ids
                self.output += action.token_ids
                member.parked, member.stopped = False, action.finish_reason
            else:
                assert isinstance(action, (StartTree, ReportTree)), action

    def tree(self) -> Optional[ReportTree]:
        """The root's reported tree, if it became one."""
        reports = [a for a in self.actions if isinstance(a, ReportTree)]
        return reports[0] if reports else None
