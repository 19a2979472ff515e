# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ThreadWeaver's format on the lifecycle (`ForkJoinPolicy` with
`ThreadWeaverFormat`) against ThreadWeaver's own controller (the test
kit's `ThreadWeaverController`), with one scripted model behind both:
token for token the same answer, model-free.

The model writes a root script and, in a thread, its label's script. The
controller decodes it call by call, as over stock vLLM; the in-engine side
decodes it in `ThreadEngine`, which carries out the coordinator's actions
(a fork copies the context and adds the header, a park waits, a resume
appends, a conclude ends) and stops a member as vLLM's stop checks do.
"""

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Optional

import pytest

from sequence_hooks.actions import (Action, Conclude, Fork, MemberResult, Park,
                                    ReportTree, RequestParams, Restart, Resume,
                                    StartTree)
from sequence_hooks.fork_join import BranchResult
from sequence_hooks.formats.threadweaver import ThreadWeaverFormat
from sequence_hooks.lifecycle import Coordinator
from sequence_hooks.special_kwargs import SpecialKwargs
from sequence_hooks_references.formats import threadweaver_controller as tw
from sequence_hooks_references.formats.backends import ScriptedBackend

TAGS = ("<Think>", "</Think>", "<Parallel>", "</Parallel>", "<Outlines>",
        "</Outlines>", "<Outline>", "</Outline>", "<Thread>", "</Thread>",
        "<Conclusion>", "</Conclusion>", "<eos>")
OFFSET = 100
SPLIT = re.compile("(" + "|".join(re.escape(t) for t in TAGS) + ")")


class TagTokenizer:
    """ThreadWeaver's tags (and `<eos>`) one token each, every other
    character one token: the tokenizer both sides share."""

    eos_token_id = TAGS.index("<eos>")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        for piece in SPLIT.split(text):
            if piece in TAGS:
                ids.append(TAGS.index(piece))
            else:
                ids += [OFFSET + ord(char) for char in piece]
        return ids

    def decode(self, token_ids: list[int]) -> str:
        return "".join(TAGS[t] if t < OFFSET else chr(t - OFFSET)
                       for t in token_ids)


TOKENIZER = TagTokenizer()
EOS = TOKENIZER.eos_token_id
OPEN_THREAD, CLOSE_THREAD = TAGS.index("<Thread>"), TAGS.index("</Thread>")
THREADS = re.compile(r"\n?<Thread>.*?</Thread>", re.DOTALL)
HEADER = re.compile(r"<Thread>\n([^:]*):")


@dataclass
class ScriptedModel:
    """Greedy decoding of fixed scripts: a thread writes its label's
    script after its header; the root writes ``root`` with every joined
    thread left out of its context. Past a script's end: EOS."""

    prompt_len: int
    root: str
    threads: dict[str, str] = field(default_factory=dict)

    def next_token(self, context: list[int]) -> int:
        ids = context[self.prompt_len:]
        opened = max((i for i, t in enumerate(ids) if t == OPEN_THREAD),
                     default=-1)
        closed = max((i for i, t in enumerate(ids) if t == CLOSE_THREAD),
                     default=-1)
        if opened > closed:
            text = TOKENIZER.decode(ids[opened:])
            label = HEADER.match(text).group(1)
            script = TOKENIZER.encode(self.threads[label])
            done = TOKENIZER.encode(text[text.index(":") + 1:])
        else:
            script = TOKENIZER.encode(self.root)
            done = TOKENIZER.encode(THREADS.sub("", TOKENIZER.decode(ids)))
        if script[:len(done)] != done or len(done) >= len(script):
            return EOS
        return script[len(done)]


@dataclass
class Member:
    tokens: list[int]
    start: int
    stop_ids: tuple[int, ...] = ()
    parked: bool = False
    stopped: Optional[str] = None


class ThreadEngine:
    """Carries out the coordinator's actions on token lists, decoding the
    members in lockstep, one token each a step, with vLLM's stop checks
    (EOS or a stop id: "stop"; the budget or the model length:
    "length"; no event for a token that ends its member)."""

    def __init__(self,
                 model: ScriptedModel,
                 max_model_len: int,
                 max_tokens: Optional[int],
                 limits: dict,
                 seed: Optional[int] = None):
        self.model = model
        self.seed = seed
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        special_kwargs = SpecialKwargs(format="threadweaver", **limits)
        self.coordinator = Coordinator.for_format(special_kwargs,
                                                  max_model_len,
                                                  TOKENIZER,
                                                  clock=lambda: 0.0)
        self.members: dict[str, Member] = {}
        self.actions: list[Action] = []
        self.output: list[int] = []

    def run(self, prompt: list[int]) -> list[int]:
        params = RequestParams(len(prompt), self.max_tokens, seed=self.seed)
        self.members["root"] = Member(list(prompt), len(prompt))
        while self.members:
            for member_id in list(self.members):
                member = self.members.get(member_id)
                if member is None or member.parked or member.stopped:
                    continue
                token = self.model.next_token(member.tokens)
                member.tokens.append(token)
                own = len(member.tokens) - member.start
                if token == EOS or token in member.stop_ids:
                    member.stopped = "stop"
                elif (len(member.tokens) >= self.max_model_len
                      or member_id == "root" and self.max_tokens is not None
                      and own >= self.max_tokens):
                    member.stopped = "length"
                else:
                    self.carry_out(
                        self.coordinator.sampled(member_id, member.tokens,
                                                 lambda: params))
            for member_id in [
                    m for m, member in self.members.items() if member.stopped
            ]:
                member = self.members.pop(member_id)
                own = member.tokens[member.start:]
                if member_id == "root":
                    self.output = own
                if self.coordinator.is_member(member_id):
                    self.carry_out(
                        self.coordinator.finished(
                            member_id, member.stopped,
                            MemberResult(own, TOKENIZER.decode(own))))
        return self.output

    def carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            self.actions.append(action)
            if isinstance(action, Fork):
                parent = self.members[action.parent_id]
                assert not parent.parked and action.max_tokens is None
                tokens = parent.tokens + list(action.context_tokens)
                self.members[action.request_id] = Member(
                    tokens, len(tokens), action.stop_token_ids)
            elif isinstance(action, Park):
                self.members[action.member_id].parked = True
            elif isinstance(action, Resume):
                member = self.members[action.member_id]
                assert member.parked and action.seed is None
                member.parked = False
                member.tokens += action.token_ids
            elif isinstance(action, Restart):
                # A new call: its prompt is the member's tokens so far.
                member = self.members[action.member_id]
                shown = len(action.shown_token_ids)
                assert action.prompt_token_ids[:-shown or None] == tuple(
                    member.tokens)
                member.parked = False
                member.tokens = list(action.prompt_token_ids)
            elif isinstance(action, Conclude):
                member = self.members[action.member_id]
                member.tokens += action.token_ids
                member.parked, member.stopped = False, "stop"
            else:
                assert isinstance(action, (StartTree, ReportTree))


PROMPT = TOKENIZER.encode("Q: 2*3*4?\n")
OUTLINES = ("<Parallel>\n<Outlines>\n<Outline>1: a</Outline>\n"
            "<Outline>2: b</Outline>\n</Outlines>")
CASES = {
    "several outlines":
    ScriptedModel(len(PROMPT), OUTLINES + "\n</Parallel>\nA: 24<eos>", {
        "1": " 2*3=6\n</Thread>",
        "2": " 6*4=24\n</Thread>"
    }),
    "a repeated label":
    ScriptedModel(
        len(PROMPT), "<Outlines>\n<Outline>1: a</Outline>\n"
        "<Outline>1: again</Outline>\n<Outline>3: c</Outline>\n</Outlines>"
        "\nok<eos>", {
            "1": " one</Thread>",
            "3": " three</Thread>"
        }),
    "a thread that hits EOS":
    ScriptedModel(len(PROMPT), OUTLINES + "\nnever", {
        "1": " done<eos>",
        "2": " fine</Thread>"
    }),
    "a thread that hits the model length":
    ScriptedModel(len(PROMPT), OUTLINES + "\nnever", {
        "1": " short</Thread>",
        "2": " " + "x" * 200
    }),
    "no outline":
    ScriptedModel(len(PROMPT), "just an answer<eos>"),
    "an outline with no label":
    ScriptedModel(
        len(PROMPT), "<Outlines>\n<Outline>a: no number</Outline>\n</Outlines>"
        " then on<eos>"),
    "two rounds":
    ScriptedModel(
        len(PROMPT), OUTLINES + "\nmid " +
        OUTLINES.replace("<Parallel>\n", "") + "\nend<eos>", {
            "1": " t1</Thread>",
            "2": " t2</Thread>"
        }),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_engine_answers_as_threadweavers_controller(name):
    model = CASES[name]
    window = 120
    controller = tw.ThreadWeaverController(TOKENIZER)
    expected = tw.run(controller, ScriptedBackend(model.next_token, EOS,
                                                  window), [PROMPT])[0][0]
    engine = ThreadEngine(model, window, None, {})
    got = engine.run(PROMPT)
    assert TOKENIZER.decode(got) == expected.text
    assert got == expected.token_ids
    forks = [a for a in engine.actions if isinstance(a, Fork)]
    assert [f.label for f in forks
            ] == [b.label for fork in expected.forks for b in fork.branches]
    # The tree is reported with its threads' labels.
    reports = [a.tree for a in engine.actions if isinstance(a, ReportTree)]
    if forks:
        (tree, ) = reports
        assert [c.label for c in tree.children] == [f.label for f in forks]
        assert all(c.finish_reason in ("stop", "length")
                   for c in tree.children)


def test_the_step_limit_and_the_budget_end_the_answer_as_the_controller():
    rounds = "".join(
        OUTLINES.replace("<Parallel>\n", "") + f"\nr{i} " for i in range(3))
    model = ScriptedModel(len(PROMPT), rounds + "end<eos>", {
        "1": " t1</Thread>",
        "2": " t2</Thread>"
    })
    window = 400
    for max_steps, budget in ((4, None), (5, None), (32, 150), (32, 95)):
        controller = tw.ThreadWeaverController(TOKENIZER,
                                               max_iterations=max_steps,
                                               response_length=budget)
        expected = tw.run(controller,
                          ScriptedBackend(model.next_token, EOS, window),
                          [PROMPT])[0][0]
        engine = ThreadEngine(model, window, budget, {})
        policy = engine.coordinator.policy
        policy.format = dataclasses.replace(policy.format, max_steps=max_steps)
        assert engine.run(PROMPT) == expected.token_ids, (max_steps, budget)


def test_the_join_is_the_controllers_template():
    fmt = ThreadWeaverFormat.for_tokenizer(TOKENIZER)
    context = PROMPT + TOKENIZER.encode(
        "<Outlines>\n<Outline>2: x</Outline>\n<Outline> 1.5 :y</Outline>\n"
        "<Outline>2: again</Outline>\n</Outlines>")
    assert fmt.labels(context) == ["2", "1.5"]
    assert [b.context_tokens for b in fmt.branches(context)] == [
        tuple(TOKENIZER.encode("\n<Thread>\n2:")),
        tuple(TOKENIZER.encode("\n<Thread>\n1.5:"))
    ]
    joined = fmt.join([
        BranchResult("2", tuple(TOKENIZER.encode(" a</Thread>")), "stop"),
        BranchResult("1.5", tuple(TOKENIZER.encode(" b")), "length"),
    ])
    assert TOKENIZER.decode(list(joined.token_ids)) == (
        "\n<Thread>\n2: a</Thread><Thread>\n1.5: b\n</Thread>\n</Parallel>")
    assert joined.final
    with pytest.raises(ValueError, match="not one token"):
        ThreadWeaverFormat.for_tokenizer(
            TOKENIZER, {
                "outlines": "<Outlines>",
                "trigger": "</Out lines>",
                "thread_end": "</Thread>"
            })


@pytest.mark.parametrize("budget", [None, 150])
def test_a_seeded_root_makes_each_call_anew_as_the_controller(budget):
    """The controller seeds every call with the request's seed; an engine
    that keeps a resumed request's generator makes the call after a join,
    or after outlines with no label, a new one (`Restart`), its budget
    what is left."""
    window = 400
    for name, calls in (("two rounds", 2), ("an outline with no label", 1)):
        model = CASES[name]
        controller = tw.ThreadWeaverController(TOKENIZER,
                                               response_length=budget)
        expected = tw.run(controller,
                          ScriptedBackend(model.next_token, EOS, window),
                          [PROMPT])[0][0]
        engine = ThreadEngine(model, window, budget, {}, seed=7)
        assert engine.run(PROMPT) == expected.token_ids, name
        assert not [a for a in engine.actions if isinstance(a, Resume)]
        restarts = [a for a in engine.actions if isinstance(a, Restart)]
        # Each is the controller's next call, none the root's end.
        assert len(restarts) == calls, name
        # The joins are shown; after outlines with no label, nothing.
        shown = [[t for b in fork.branches
                  for t in b.joined_ids] + fork.suffix_ids
                 for fork in expected.forks] or [[]]
        assert [list(r.shown_token_ids) for r in restarts] == shown, name
        for restart in restarts:
            own = len(restart.prompt_token_ids) - len(PROMPT)
            assert restart.max_tokens == (None if budget is None else budget -
                                          own)
        assert all(f.seed == 7 for f in engine.actions if isinstance(f, Fork))


@pytest.mark.parametrize("limits,forked,parks", [
    ({
        "max_children_per_sequence": 1
    }, ["1", "1"], 2),
    ({
        "max_children_per_request": 3
    }, ["1", "2", "1"], 2),
    ({
        "max_children_per_request": 2
    }, ["1", "2"], 1),
])
def test_the_limits_refuse_branches_and_a_fork_with_none_decodes_on(
        limits, forked, parks):
    """A fork starts `max_children_per_sequence` branches at most, within
    what is left of `max_children_per_request` (the controller has no
    limit: a documented difference); refused ones are counted, and a fork
    left with none decodes on, as after outlines with no label, never
    parked with nothing to wait for."""
    engine = ThreadEngine(CASES["two rounds"], 400, None, limits)
    answer = TOKENIZER.decode(engine.run(PROMPT))
    assert answer.endswith("end<eos>")
    assert [a.label for a in engine.actions if isinstance(a, Fork)] == forked
    assert len([a for a in engine.actions if isinstance(a, Park)]) == parks
    [start] = [a for a in engine.actions if isinstance(a, StartTree)]
    assert start.tree.num_refused == 4 - len(forked)


@pytest.mark.parametrize("seed", [None, 7], ids=["unseeded", "seeded"])
def test_a_fork_with_no_room_for_a_thread_decodes_on_to_the_window(seed):
    """Outlines that close with no room left for a thread's header and
    one token: no thread forks (the controller's server would refuse its
    call); the root decodes on and ends at the window."""
    at_trigger = len(PROMPT) + len(TOKENIZER.encode(OUTLINES))
    window = at_trigger + len(TOKENIZER.encode(tw.first_header("1")))
    engine = ThreadEngine(CASES["several outlines"], window, None, {}, seed)
    got = engine.run(PROMPT)
    assert not [a for a in engine.actions if isinstance(a, Fork)]
    assert len(PROMPT) + len(got) == window
    assert TOKENIZER.decode(got).startswith(OUTLINES + "\n</Parallel>")
    [report] = [a for a in engine.actions if isinstance(a, ReportTree)]
    assert report.tree.finish_reason == "length"


def test_a_requests_own_stop_makes_the_controller_call_again():
    """The controller merges the request's stop ids into its calls'; a
    call that ends at one (neither EOS nor length) is followed by another
    sequential call from the whole context, where the engine ends the
    answer (docs/formats.md: a difference of the engine's)."""
    model = CASES["several outlines"]
    stop = TOKENIZER.encode("A")[0]
    backend = ScriptedBackend(model.next_token, EOS, 120)
    plain = tw.run(tw.ThreadWeaverController(TOKENIZER), backend,
                   [PROMPT])[0][0]
    stopped = tw.run(tw.ThreadWeaverController(TOKENIZER), backend, [PROMPT], {
        "temperature": 0.0,
        "stop_token_ids": [stop]
    })[0][0]
    # "A" after the join: one more call, the same answer.
    assert stopped.token_ids == plain.token_ids
    assert stopped.calls == plain.calls + 1
