# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fuzzed inputs of the formats whose join splices its paths' KV (NPR's
and Multiverse's, `sequence_hooks.splice_join`), model-free.

Hypothesis mutates what a model writes (its goals, its paths, what
follows a join) and the prompt, as test_formats_fuzz.py does for the
other formats: tags cut short, out of order or inside the prompt, a
goal's closing tag with no goal open, repeated, unknown, non-numeric and
huge labels, more than five, none, non-ASCII text, paths that never
close, an EOS anywhere; with no budget or one of 0 to 120 tokens, a small
window, the fork limits, Multiverse's nesting (and NPR paths that write a
goal), either join, and the request aborted at any step. `SpliceEngine`
plays each tree through the real coordinator as an engine would and
checks every action against the formats' published rules
(docs/formats.md, "Multiverse and NPR"), written out here (`Rules`), not
read from the product:

- no exception escapes the coordinator (one would end the engine core);
- a goal's closing tag forks one path per label its goal lists, in
  order, repeats kept, each with the context ``"\\n"`` and its header;
  none with no label, more than five, no room in the window, or in an
  NPR path; the fork limits keep the first ones;
- a path's closing tag gets the newline, the token after it ends it;
- a join comes once the parked member's paths have all finished: a
  `Splice` of those paths in fork order, each range computed in its path
  and anchored at its closing tag, closing with the format's after-tag,
  the joined tokens the newline, each path's header and tokens and the
  after-tag, room left for a token; or (``join: "prefill"``) a `Resume`
  of those tokens; or a `Conclude` of the paths' text up to the first
  that did not close, cut only at the budget or the window, and of
  closed paths only when their splice would not fit;
- the tree ends within a bound of steps, its root reported once with its
  tree (unless the request was aborted), and the coordinator then holds
  nothing: no member, nothing parked or counted running.

`test_a_well_formed_block_joins_as_its_paths_written_out` checks the
join of blocks that are well formed against the joined text spelled out
literally.
"""

import re
from dataclasses import dataclass, field
from random import Random
from typing import Optional

import pytest
from fake_engine import TagTokenizer
from hypothesis import event, given
from hypothesis import strategies as st
from test_formats_fuzz import FUZZ, NON_ASCII, assert_nothing_left, mutated

from sequence_hooks.actions import (Abort, Action, Conclude, Fork,
                                    MemberResult, Park, ReportTree,
                                    RequestParams, Resume, Splice, StartTree)
from sequence_hooks.lifecycle import Coordinator
from sequence_hooks.special_kwargs import SpecialKwargs

# Both formats' tags, one token each, so that either may write the
# other's (unknown tags); every other character is one token.
TAGS = ("<guideline>", "</guideline>", "<plan>", "</plan>", "<step>",
        "</step>", "<takeaway>", "</takeaway>", "<Parallel>", "</Parallel>",
        "<Goal>", "</Goal>", "<Outline>", "</Outline>", "<Path>", "</Path>",
        "<Conclusion>", "</Conclusion>", "<eos>")
TOKENIZER = TagTokenizer(TAGS)
EOS = TOKENIZER.eos_token_id
ids = TOKENIZER.encode
(NEWLINE, ) = ids("\n")
ROOT = "root"
# A goal listing more labels forks no path (docs/formats.md).
MAX_PATHS = 5


@dataclass(frozen=True)
class Rules:
    """A format's published rules (docs/formats.md), written out here."""

    name: str
    goal_open: str
    trigger: str
    path_open: str
    path_close: str
    # What a join computes after the paths.
    after: str
    # The format's engines' regex: a label is its group.
    label: re.Pattern
    # Whether a path forks blocks of its own.
    nests: bool
    # A goal listing ``labels``, well formed.
    goal: str

    def id_of(self, tag: str) -> int:
        (token, ) = ids(tag)
        return token

    def header(self, label: str) -> list[int]:
        return ids(f"{self.path_open}\n{label}:")

    def labels(self, tokens: list[int]) -> list[str]:
        """The labels the last goal in ``tokens`` lists, in order."""
        goal = self.id_of(self.goal_open)
        if goal not in tokens:
            return []
        at = len(tokens) - 1 - tokens[::-1].index(goal)
        return self.label.findall(TOKENIZER.decode(tokens[at:]))


NPR = Rules("npr", "<guideline>", "</guideline>", "<step>",
            "</step>", "<takeaway>\n",
            re.compile(r"<plan>\s*([0-9]+(?:\.[0-9]+)*)\s*:"), False,
            "<guideline>{}</guideline>")
MULTIVERSE = Rules("multiverse", "<Goal>", "</Goal>", "<Path>", "</Path>",
                   "<Conclusion>\n",
                   re.compile(r"<Outline>\s*([0-9]+(?:\.[0-9]+)*)\s*:"), True,
                   "<Goal>\n{}</Goal>")
FORMATS = [NPR, MULTIVERSE]


def listed(rules: Rules, labels: list[str]) -> str:
    """A well-formed goal of ``rules`` listing ``labels``."""
    entry = "<plan>{}: do</plan>" if rules is NPR else "<Outline>{}: do\n"
    return rules.goal.format("".join(entry.format(lb) for lb in labels))


@dataclass
class Member:
    """A sequence as the engine holds it."""

    tokens: list[int]
    # Where its own tokens start.
    start: int
    # Its own tokens at most.
    budget: int
    # What the model writes: the script's tokens, then EOS.
    script: list[int]
    at: int = 0
    # Its tokens with KV (all but the last sampled and any concluded).
    computed: int = 0
    parked: bool = False
    stopped: Optional[str] = None
    # Given its newline after its closing tag.
    closing: bool = False
    # Its open block's forks, and its length at the fork.
    block: list[Fork] = field(default_factory=list)
    fork_length: int = 0


@dataclass(frozen=True)
class Ended:
    """A reported path: why it ended, its whole tokens and own tokens
    less the one dropped after its newline, and how many are computed."""

    reason: str
    tokens: list[int]
    kept: list[int]
    computed: int


class SpliceEngine:
    """An engine with a scripted model that runs one request's tree
    through the coordinator: each step every running member samples its
    script's next token (EOS past its end), in a drawn order, and ends at
    EOS ("stop"), its budget or the window ("length", no event for the
    token that ends it, as vLLM's stop checks); then the members that
    ended are reported, in a drawn order. A fork starts a path on its
    parent's tokens and its context, its budget the window left (a fork
    with no budget, as V1 runs it), its script the next of
    ``path_scripts`` in turn; a park waits; a resume appends; a splice
    continues the parent with each path's range, then the closing
    tokens; a conclude appends and ends. Every action is checked against
    `Rules` before it is carried out.

    Args:
        rules: The format.
        window: The model length.
        max_tokens: The request's budget (None: none).
        join: The ``join`` option.
        per_sequence: `max_children_per_sequence`.
        per_request: `max_children_per_request`.
        order: Orders each step's samples and reports.
        abort_at: The step at which the client aborts the request (the
            root's request ends, the coordinator is told of
            ``abort_pick``'s member); None: never.
        abort_pick: Which live member the abort names.
    """

    def __init__(self,
                 rules: Rules,
                 window: int,
                 max_tokens: Optional[int],
                 join: str = "splice",
                 per_sequence: int = 16,
                 per_request: int = 64,
                 order: Optional[Random] = None,
                 abort_at: Optional[int] = None,
                 abort_pick: int = 0):
        self.rules = rules
        self.window = window
        self.max_tokens = max_tokens
        self.prefill = join == "prefill"
        self.per_sequence = per_sequence
        self.per_request = per_request
        self.order = order or Random(0)
        self.abort_at = abort_at
        self.abort_pick = abort_pick
        special_kwargs = SpecialKwargs(format=rules.name,
                                       format_options={"join": join},
                                       max_children_per_sequence=per_sequence,
                                       max_children_per_request=per_request)
        self.coordinator = Coordinator.for_format(special_kwargs,
                                                  window,
                                                  TOKENIZER,
                                                  clock=lambda: 0.0)
        self.trigger = rules.id_of(rules.trigger)
        self.close = rules.id_of(rules.path_close)
        self.members: dict[str, Member] = {}
        self.ended: dict[str, Ended] = {}
        self.parent_of: dict[str, str] = {}
        self.forks: list[Fork] = []
        self.started = self.aborted = False
        self.reports: list[ReportTree] = []
        # Each join: its action and the tokens it appended.
        self.joins: list[tuple[Action, list[int]]] = []
        self.steps = 0

    def run(self, prompt: list[int], root_script: list[int],
            path_scripts: list[list[int]]) -> None:
        """Runs the request to its end."""
        self.path_scripts = path_scripts
        self.params = RequestParams(len(prompt), self.max_tokens)
        room = self.window - len(prompt)
        budget = room if self.max_tokens is None else min(
            self.max_tokens, room)
        self.members[ROOT] = Member(list(prompt), len(prompt), budget,
                                    root_script)
        # Each step samples a token or reports a member, and a member
        # samples at most the window: past this, the tree would not end.
        bound = (self.per_request + 1) * (self.window + 1)
        while self.members:
            self.steps += 1
            assert self.steps <= bound, "the tree does not end"
            root = self.members.get(ROOT)
            if (self.steps == self.abort_at and root is not None
                    and not root.stopped):
                self.abort()
                if not self.members:
                    break
            running = [
                i for i, m in self.members.items()
                if not m.parked and not m.stopped
            ]
            ended = [i for i, m in self.members.items() if m.stopped]
            assert running or ended, f"a hang: {sorted(self.members)} parked"
            self.order.shuffle(running)
            for member_id in running:
                member = self.members.get(member_id)
                if member and not member.parked and not member.stopped:
                    self.sample(member_id, member)
            ended = [i for i, m in self.members.items() if m.stopped]
            self.order.shuffle(ended)
            for member_id in ended:
                self.report(member_id)
        self.check_end()

    def sample(self, member_id: str, member: Member) -> None:
        token = (member.script[member.at]
                 if member.at < len(member.script) else EOS)
        member.at += 1
        member.computed = len(member.tokens)
        member.tokens.append(token)
        if token == EOS:
            member.stopped = "stop"
        elif (len(member.tokens) >= self.window
              or len(member.tokens) - member.start >= member.budget):
            member.stopped = "length"
        else:
            actions = self.coordinator.sampled(member_id, member.tokens,
                                               lambda: self.params)
            self.check_sampled(member_id, member, actions)
            self.carry_out(actions)

    def report(self, member_id: str) -> None:
        member = self.members.pop(member_id)
        own = member.tokens[member.start:]
        join_of = None
        if member_id != ROOT:
            # The token after a path's newline is dropped: the path
            # closed, whatever ended it there.
            dropped = int(member.closing)
            self.ended[member_id] = Ended(
                "stop" if member.closing else member.stopped,
                member.tokens[:len(member.tokens) - dropped],
                own[:len(own) - dropped], member.computed)
            parent = self.members.get(self.parent_of[member_id])
            if (not self.aborted and parent is not None and parent.parked
                    and all(f.request_id in self.ended for f in parent.block)):
                join_of = self.parent_of[member_id]
        actions = self.coordinator.finished(member_id, member.stopped,
                                            MemberResult(own, None))
        if self.aborted:
            assert actions == []
        elif member_id == ROOT:
            reported = [type(action) for action in actions]
            assert reported == ([ReportTree] if self.started else [])
        elif join_of is None:
            assert actions == []
        else:
            (join, ) = actions
            assert isinstance(join, (Splice, Conclude, Resume))
            assert join.member_id == join_of
        self.carry_out(actions)

    def abort(self) -> None:
        """The client aborts the request: the engine ends its root; the
        coordinator, told of any of its members, aborts the others."""
        live = sorted(self.members)
        target = live[self.abort_pick % len(live)]
        del self.members[ROOT]
        self.aborted = True
        actions = self.coordinator.aborted(target)
        # Every path not reported yet, those ended unreported too.
        paths = set(self.members)
        if paths:
            (abort, ) = actions
            assert isinstance(abort, Abort)
            assert sorted(abort.member_ids) == sorted(paths)
        else:
            assert actions == []
        self.carry_out(actions)

    def expected_forks(self, member_id: str, member: Member) -> list[str]:
        """The labels a sampled token forks paths for; none: the member
        decodes on."""
        rules, tokens = self.rules, member.tokens
        if tokens[-1] != self.trigger or (member_id != ROOT
                                          and not rules.nests):
            return []
        labels = rules.labels(tokens)
        if len(labels) > MAX_PATHS:
            return []
        limit = min(self.per_sequence, self.per_request - len(self.forks))
        labels = labels[:max(limit, 0)]
        # Each path needs room to sample a token.
        if any(
                len(tokens) + 1 + len(rules.header(label)) >= self.window
                for label in labels):
            return []
        return labels

    def check_sampled(self, member_id: str, member: Member,
                      actions: list[Action]) -> None:
        if member.closing:
            assert actions == [Conclude(member_id, (), 0.0)]
            return
        if member_id != ROOT and member.tokens[-1] == self.close:
            assert actions == [Resume(member_id, (NEWLINE, ), 0.0, None)]
            return
        head = []
        if member.tokens[-1] == self.trigger and not self.started:
            assert member_id == ROOT
            head = [StartTree]
        labels = self.expected_forks(member_id, member)
        shapes = head + [Fork] * len(labels) + ([Park] if labels else [])
        assert [type(a) for a in actions] == shapes, (labels, actions)
        forks = actions[len(head):len(head) + len(labels)]
        assert [fork.label for fork in forks] == labels
        shift = None if self.prefill else (1, -1)
        for fork in forks:
            assert fork.parent_id == member_id and not fork.fresh
            assert fork.context_tokens == (NEWLINE,
                                           *self.rules.header(fork.label))
            assert fork.max_tokens is None and fork.seed is None
            assert fork.position_shift == shift
        if labels:
            assert actions[-1] == Park(member_id)

    def carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, StartTree):
                assert action.root_id == ROOT and not self.started
                self.started = True
            elif isinstance(action, Fork):
                self.fork(action)
            elif isinstance(action, Park):
                member = self.members[action.member_id]
                assert member.block and not member.parked
                member.parked = True
                member.fork_length = len(member.tokens)
            elif isinstance(action, (Resume, Splice)):
                self.resume(action)
            elif isinstance(action, Conclude):
                self.conclude(action)
            elif isinstance(action, Abort):
                for member_id in action.member_ids:
                    member = self.members[member_id]
                    # One ended already is reported, and void.
                    if not member.stopped:
                        del self.members[member_id]
            else:
                assert isinstance(action, ReportTree), action
                assert action.root_id == ROOT and not self.reports
                self.reports.append(action)

    def fork(self, fork: Fork) -> None:
        parent = self.members[fork.parent_id]
        assert not parent.parked and not parent.stopped
        tokens = parent.tokens + list(fork.context_tokens)
        script = self.path_scripts[len(self.forks) % len(self.path_scripts)]
        self.members[fork.request_id] = Member(tokens, len(tokens),
                                               self.window - len(tokens),
                                               script)
        self.parent_of[fork.request_id] = fork.parent_id
        self.forks.append(fork)
        parent.block.append(fork)
        assert len(parent.block) <= MAX_PATHS

    def paths_text(self, parent: Member) -> tuple[list[int], bool]:
        """The paths' text as one decoding of them in turn gives it: the
        newline, then each path's header and tokens, up to the first path
        that did not close; and whether every path closed."""
        text, closed = [NEWLINE], True
        for fork in parent.block:
            path = self.ended[fork.request_id]
            text += self.rules.header(fork.label or "") + path.kept
            closed = closed and path.reason == "stop"
            if path.kept[-2:] != [self.close, NEWLINE]:
                return text, False
        return text, closed

    def room(self, member: Member) -> tuple[int, Optional[int]]:
        """What the window and the budget leave a member."""
        used = len(member.tokens) - member.start
        return (self.window - len(member.tokens),
                None if self.max_tokens is None else self.max_tokens - used)

    def resume(self, action: Resume | Splice) -> None:
        """A path's newline (checked with its event), or a parked
        member's join of its closed paths: a splice of their computed
        ranges, or their text computed (``join: "prefill"``)."""
        member = self.members[action.member_id]
        if not member.parked:
            member.tokens += action.token_ids
            member.closing = True
            return
        text, closed = self.paths_text(member)
        assert closed
        after = ids(self.rules.after)
        if isinstance(action, Resume):
            assert self.prefill and action.seed is None
            appended = list(action.token_ids)
        else:
            assert not self.prefill
            assert [p.member_id for p in action.paths
                    ] == [f.request_id for f in member.block]
            assert action.closing_token_ids == tuple(after)
            spliced = []
            for i, (fork, path) in enumerate(zip(member.block, action.paths)):
                ended = self.ended[fork.request_id]
                assert path.start < path.end and (path.start <= path.anchor <
                                                  path.end)
                # The first path from the goal's closing tag, the
                # parent's computed frontier; the others from their
                # header (their newline is the first's).
                assert path.start == (member.computed
                                      if i == 0 else member.fork_length + 1)
                # Only computed tokens have KV to reuse.
                assert path.end == len(ended.tokens) <= ended.computed
                assert ended.tokens[path.anchor] == self.close
                spliced += ended.tokens[path.start:path.end]
            assert spliced[0] == member.tokens[-1] == self.trigger
            appended = spliced[1:] + after
        assert appended == text + after
        member.tokens += appended
        member.parked, member.block = False, []
        self.joins.append((action, appended))
        # Room for a sampled token.
        window, budget = self.room(member)
        assert window > 0 and (budget is None or budget > 0)

    def conclude(self, action: Conclude) -> None:
        member = self.members[action.member_id]
        if not member.parked:
            # A path's token after its newline (checked with its event).
            member.stopped = "stop"
            return
        text, closed = self.paths_text(member)
        window, budget = self.room(member)
        room = window if budget is None else min(window, budget)
        if closed:
            # Closed paths end the answer only for want of room: their
            # text and the closing tokens, as far as they fit.
            text = text + ids(self.rules.after)
            total = len(text)
            assert total >= window or budget is not None and total >= budget
        # Cut only at the window or the budget, and then a "length" end.
        assert list(action.token_ids) == text[:max(room, 0)]
        assert action.finish_reason == ("length"
                                        if len(text) >= room else "stop")
        member.tokens += action.token_ids
        member.parked, member.block = False, []
        member.stopped = "stop"
        self.joins.append((action, list(action.token_ids)))

    def check_end(self) -> None:
        """The tree ended, reported unless aborted, and nothing is left."""
        if self.started and not self.aborted:
            (report, ) = self.reports
            tree = report.tree
            assert tree.request_id == ROOT
            assert tree.finish_reason in ("stop", "length")
            assert [child.label for child in tree.children
                    ] == [f.label for f in self.forks if f.parent_id == ROOT]
            nodes = [tree]
            while nodes:
                node = nodes.pop()
                assert node.finish_reason is not None
                nodes += node.children
        else:
            assert not self.reports
        assert_nothing_left(self.coordinator)


# What a model may write, and a user may send, in either format.
FRAGMENTS = [
    *TAGS, "<guideline", "</guidel", "<pla", "</ste", "<Goa", "</Goal", "<Pat",
    "</Pat", "<takeaway", "<Conclu", "<plan>1:", "<plan>2: b</plan>",
    "<plan>1: again</plan>", "<plan>99999999999999999999:", "<plan>1.2.3:",
    "<plan> 3 :", "<plan>a: x", "<plan>٣:", "<plan>:",
    "<plan>1:<plan>2:<plan>3:<plan>4:<plan>5:<plan>6:", "<Outline>1:",
    "<Outline>2: b\n", "<Outline>1: again\n", "<Outline>99999999999999999999:",
    "<Outline>1.2.3:", "<Outline> 3 :", "<Outline>a: x", "<Outline>٣:",
    "<Outline>1:<Outline>2:<Outline>3:<Outline>4:<Outline>5:<Outline>6:",
    "<guideline><plan>1: p</plan>", "<Goal>\n<Outline>1: p\n",
    "<guideline><plan>1: n</plan></guideline>", "<Goal><Outline>1: n</Goal>",
    "</step>\n", "</Path>\n", ":", "\n", " ", *NON_ASCII
]
SWAPS = [
    "</step>=>", "</Path>=>", "</step>=><eos>", "</Path>=><eos>",
    "</guideline>=><guideline>", "</Goal>=><Goal>", "<guideline>=>",
    "<Goal>=>", "</guideline>=></guideline></guideline>",
    "</Goal>=></Goal></Goal>", "2: =>1: ", "2: =>a: ",
    "2: =>99999999999999999999: ", "1: =>1.1: ", "<plan>=><Outline>",
    "<Outline>=><plan>", "</takeaway>=><guideline>", "<step>=></step>"
]
PROMPT = "Q: 1+2?\n"
# More labels than a block forks paths for.
SIX = [str(i) for i in range(1, MAX_PATHS + 2)]
ROOTS = {
    "npr": [
        "<guideline>\n<plan>1: add</plan>\n<plan>2: check</plan>\n"
        "</guideline>3</takeaway>\nA: 3",
        "<guideline><plan>1: a</plan></guideline>x</takeaway>\nthen "
        "<guideline><plan>1: b</plan><plan>2: c</plan></guideline>y"
        "</takeaway>\nend",
        listed(NPR, SIX) + "six</takeaway>\n"
    ],
    "multiverse": [
        "<Parallel>\n<Goal>\n<Outline>1: a\n<Outline>2: b\n</Goal>both"
        "</Conclusion>\n</Parallel>\nA: 3",
        "<Goal><Outline>1: a</Goal>x</Conclusion>\nthen <Goal><Outline>1: "
        "b<Outline>2: c</Goal>y</Conclusion>\nend",
        listed(MULTIVERSE, SIX) + "six</Conclusion>\n"
    ],
}
PATHS = {
    "npr": [
        " 1+2=3</step>", " ok</step>\nnext",
        " <guideline><plan>1: n</plan></guideline> n</step>", " open"
    ],
    "multiverse": [
        " a</Path>", " ok</Path>\nnext",
        " <Parallel>\n<Goal>\n<Outline>1: n\n<Outline>2: m\n</Goal>n+m"
        "</Conclusion>\n</Parallel>\n</Path>", " open"
    ],
}


def texts(bases: list[str]) -> st.SearchStrategy[str]:
    return st.sampled_from(bases).flatmap(
        lambda text: mutated(text, FRAGMENTS, SWAPS))


@pytest.mark.parametrize("rules", FORMATS, ids=lambda rules: rules.name)
@FUZZ
@given(data=st.data(),
       prompt=mutated(PROMPT, FRAGMENTS, SWAPS),
       window=st.just(400) | st.integers(8, 400),
       max_tokens=st.none() | st.integers(0, 120),
       join=st.sampled_from(["splice", "prefill"]),
       per_sequence=st.just(16) | st.integers(1, 6),
       per_request=st.just(64) | st.integers(1, 8),
       abort_at=st.none() | st.integers(1, 150),
       abort_pick=st.integers(0, 7),
       order=st.randoms(use_true_random=False))
def test_fuzzed_trees_follow_the_published_rules(rules, data, prompt, window,
                                                 max_tokens, join,
                                                 per_sequence, per_request,
                                                 abort_at, abort_pick, order):
    root = data.draw(texts(ROOTS[rules.name]), label="root")
    paths = data.draw(st.lists(texts(PATHS[rules.name]),
                               min_size=1,
                               max_size=3),
                      label="paths")
    engine = SpliceEngine(rules, window, max_tokens, join, per_sequence,
                          per_request, order, abort_at, abort_pick)
    engine.run(
        ids(prompt)[:window - 1], ids(root), [ids(path) for path in paths])
    # What the tree reached (pytest --hypothesis-show-statistics).
    joins = {type(action).__name__ for action, _ in engine.joins}
    nested = any(fork.parent_id != ROOT for fork in engine.forks)
    event(f"{rules.name}: {min(len(engine.forks), 4)} paths (4: or more), "
          f"nested: {nested}, joins {sorted(joins)}, "
          f"aborted: {engine.aborted}")


LABEL = st.from_regex(r"[0-9]{1,4}(\.[0-9]{1,3}){0,2}", fullmatch=True)
# A path's text: any characters but a tag's first.
BODY = st.text(st.characters(blacklist_characters="<",
                             blacklist_categories=("Cs", )),
               max_size=6)


@pytest.mark.parametrize("rules", FORMATS, ids=lambda rules: rules.name)
@FUZZ
@given(labels=st.lists(LABEL, min_size=1, max_size=MAX_PATHS),
       bodies=st.lists(BODY, min_size=MAX_PATHS, max_size=MAX_PATHS),
       tail=st.sampled_from(["", "z"]),
       join=st.sampled_from(["splice", "prefill"]),
       order=st.randoms(use_true_random=False))
def test_a_well_formed_block_joins_as_its_paths_written_out(
        rules, labels, bodies, tail, join, order):
    """Paths that all close, with room: one join, its tokens the newline,
    each path's header and text and the after-tag, spelled out."""
    engine = SpliceEngine(rules, 1000, None, join, order=order)
    # Each path's closing tag, then EOS or a token that is dropped.
    engine.run(ids(PROMPT), ids(listed(rules, labels) + "done"),
               [ids(body + rules.path_close + tail) for body in bodies])
    if rules is NPR:
        expected = "\n" + "".join(f"<step>\n{label}:{body}</step>\n"
                                  for label, body in zip(labels, bodies))
        expected += "<takeaway>\n"
    else:
        expected = "\n" + "".join(f"<Path>\n{label}:{body}</Path>\n"
                                  for label, body in zip(labels, bodies))
        expected += "<Conclusion>\n"
    ((action, appended), ) = engine.joins
    assert isinstance(action, Resume if join == "prefill" else Splice)
    assert appended == ids(expected)
    assert TOKENIZER.decode(appended) == expected
