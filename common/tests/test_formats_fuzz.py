# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fuzzed format inputs, model-free: what a model may write and a user may
send, through every format's lifecycle.

Hypothesis mutates the texts each format's tests script a model with, and
the prompt: tags cut short, repeated, unknown or out of place (inside the
prompt too), repeated and unknown labels and nodes, a value of another
type where a list belongs (APR's ``Operations: None``), nested lists,
huge numbers, non-ASCII text, special tokens spelled mid-text. A scripted
model writes them, and the engine's side, the coordinator behind each
format's own test engine (`test_apr.SearchEngine`,
`test_threadweaver.ThreadEngine`, `fake_engine.FakeEngine`), must

- never raise: an exception out of the coordinator is one out of the
  engine core, which ends every request it holds;
- end: every scripted model ends each call (at its script's end, its
  budget or the window), so a run that does not end is the lifecycle's
  (an APR search is given 20,000 tokens, `Bounded`);
- answer as the format's reference on the same model: the references'
  controllers for APR and ThreadWeaver (`sequence_hooks_references`,
  which share no code with the product), the contract's
  `reference.ReferenceEngine` for promise/sync;
  where the reference defines no answer (a ThreadWeaver thread with no
  room left in the window: its server refuses the call; an APR search
  the reference never ends) the engine's still ends (ThreadWeaver's
  within the window and the budget);
- leave nothing behind: no member tracked, no child running, no parent
  parked (the counts the `sequence_hook_children_running` and
  `sequence_hook_parents_parked` gauges export).

Each defect the fuzzing found, all APR's, is pinned by a test of its
own: a malformed call (``Operations: None``, numbers that are not a list,
a parser stack overflow...) must end the search as the reference's
``except Exception`` does, whatever reading it raises; a state with a
second colon is read as the reference reads it; `<Sub Searches>` is
found with a special token sampled inside it, and on the last token of a
call's budget; a call its search made before, which the reference
would repeat forever, ends the search.

Promise/sync's hook tags spelled in a member's own text are left out of
its fuzzing (prompts have them): the lifecycle removes them from member
texts by string (`texts.without_hook_tokens`), so a child that writes
the characters `<sync>` loses them from its text and its merge, where
the contract keeps them, a difference of `lifecycle.py`'s, reported
apart.
"""

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Optional

import pytest
import test_apr
import test_threadweaver as tw_test
from fake_engine import OFFSET, PROMISE, ROLE, SYNC, FakeEngine
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from reference import ReferenceEngine

from sequence_hooks.actions import Fork, RequestParams
from sequence_hooks_references.formats import threadweaver_controller as tw
from sequence_hooks_references.formats.apr_controller import (APRController,
                                                              APRRollout,
                                                              run_apr)
from sequence_hooks_references.formats.apr_trace import CALLING, generated
from sequence_hooks_references.formats.backends import (Recorded,
                                                        ScriptedBackend,
                                                        ScriptedTextBackend)
from sequence_hooks_testkit.formats import apr_scripts as apr
from sequence_hooks_testkit.formats import threadweaver_scripts as tw_scripts

# Examples per fuzzed test (FORMAT_FUZZ_EXAMPLES: more for a longer hunt).
FUZZ = settings(max_examples=int(os.environ.get("FORMAT_FUZZ_EXAMPLES",
                                                "150")),
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

# Mutations of a text.


def apply_edits(text: str, edits: list[tuple[str, int, str]]) -> str:
    """``text`` with each edit made in turn: ``(kind, at, what)``, ``at``
    taken modulo the text's length (and one)."""
    for kind, at, what in edits:
        at %= len(text) + 1
        if kind == "insert":
            text = text[:at] + what + text[at:]
        elif kind == "cut":
            text = text[:at]
        elif kind == "delete":
            text = text[:at] + text[at + len(what):]
        elif kind == "repeat":
            # The line around ``at``, twice.
            start = text.rfind("\n", 0, at) + 1
            end = text.find("\n", at)
            end = len(text) if end < 0 else end + 1
            text = text[:end] + text[start:end] + text[end:]
        else:
            old, new = what.split("=>")
            text = text.replace(old, new, 1)
    return text


def mutated(text: str, fragments: list[str],
            swaps: list[str]) -> st.SearchStrategy[str]:
    """``text`` as it is (half the time, so that what follows it is
    reached too), or with up to four edits: fragments inserted (or a few
    characters of any script), cuts, deletions, a line repeated, a
    substring swapped (``swaps``: ``"old=>new"``)."""
    pieces = st.sampled_from(fragments) | st.text(max_size=3)
    edit = st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 1 << 16), pieces),
        st.tuples(st.just("cut"), st.integers(0, 1 << 16), st.just("")),
        st.tuples(st.just("delete"), st.integers(0, 1 << 16),
                  st.text(min_size=1, max_size=12)),
        st.tuples(st.just("repeat"), st.integers(0, 1 << 16), st.just("")),
        st.tuples(st.just("swap"), st.just(0), st.sampled_from(swaps)))
    return st.just(text) | st.lists(
        edit, min_size=1, max_size=4).map(lambda e: apply_edits(text, e))


NON_ASCII = ["é", "\u200b", "\u202e", "中文", "🙂", "٣٩", "\x00"]

# APR: the test engine and tokenizer of `test_apr` (its tags and "]\n"
# one token each, every other character one token).
TOKENIZER, BOS, EOS = test_apr.TOKENIZER, test_apr.BOS, test_apr.EOS
JOINED = "<End Sub Searches>\n"
LONGEST_PIECE = max(map(len, TOKENIZER.pieces))
APR_TAGS = [
    "<Sub Searches>", "<Sub Searches>\n", "<Calling Sub Searches>\n",
    "<Calling Sub Searches>", "<End Calling Sub Searches>",
    "<End Calling Sub Searches>\n", "<End Calling Sub Searches", "<Sub Sea",
    "<Calling Sub Sea", "<Sub Sea<s>rches>", JOINED,
    "<Start Sub Search 0 at level 1> Moving to Node #0,0\n",
    "<Start Sub Search 7 at level 1> Moving to Node #0,9\n",
    "<Start Sub Search 1 at level 1> Moving to Node #\n",
    "<Start Sub Search 1 at level 1> Moving to Node #0,0,0\n",
    "<Goal Reached in Sub Search 0 at level 1 at Node #0,0>\n",
    "<No Solution in Sub Search 0 at level 1 at Node #0,0>\n", "Goal Reached",
    "39,39 equal: Goal Reached\n", "Moving to Node #", "Current State: ",
    "Generated Node #0,0,0: 39:[1, 2] Operation: 1+1=2\n",
    "Generated Node #0,1: 39:[7] Operation: 7*1=7\n",
    "Generated Node #0,0,1: 39:5 Operation: 1+1=2\n",
    "Moving to Node #0,1\nCurrent State: 39:[51, 49, 11], Operations: None\n",
    "Operations: None", "Operations: 'x'", "None", "'x'", "[[1, [2, [3]]]]",
    "{[1]: 2}", "99999999999999999999999", "1e999", "-0", ":", "],", "#", "\n",
    "<s>", "</s>", *NON_ASCII
]
APR_SWAPS = [
    "Operations: []=>Operations: None", "Operations: []=>Operations: 'x'",
    "Operations: []=>Operations: [[]]", "Operations: []=>Operations: {1, 2}",
    "[25, 36, 51, 49]=>[25, [36, [51]], 49]",
    "[25, 36, 51, 49]=>[25, 36:51, 49]", "39:=>99999999999999999999:",
    "39:=>٣٩:", "39:[25, 36, 2] =>39:[25, 36, 2]:9 ", "39:[25, 36, 2] =>39:7 ",
    "#0,1=>#0,0", "#0,0\n=>#0,7\n", "Operation: =>Operation: Operation: ",
    "<End Calling=>End Calling",
    "\n<End Calling Sub Searches>=><End Calling Sub Searches>"
]
# Calls listing more nodes than the default limits (the one difference
# from the controller) are compared with the limits out of reach.
APR_LIMITS = {
    "max_children_per_sequence": 1000,
    "max_children_per_request": 1000
}
APR_WINDOW = 1 << 16
# Tokens a search may sample, far more than any of these scripts makes.
MAX_SAMPLED = 20_000


@dataclass(frozen=True)
class SearchModel:
    """Greedy decoding of texts, special tokens spelled (so a script may
    hold a BOS or an EOS mid-text): the first script the context's text
    begins goes on with its next token. After a k-th join (the context
    holds `<End Sub Searches>` k times) the root writes ``after[k - 1]``,
    then EOS; a context no script begins (a sub-search of a node no
    script knows) writes ``other`` after its first two lines, unless the
    controller has rewritten it (it holds `<Calling Sub Searches>`). At
    a script's end: EOS.

    Every call ends (at EOS or its budget), and so do a call's rewrites
    (each needs the model to write `<Sub Searches>` where a fixed script
    holds the rewritten text); a search whose joins cut its earlier
    joins away may not (`Bounded` ends it)."""

    scripts: tuple[str, ...]
    after: tuple[str, ...]
    other: str
    # Each context's text seen, by its ids: most contexts are one seen
    # and a token more.
    texts: dict = field(default_factory=dict, compare=False)

    def text(self, context: list[int]) -> str:
        ids = tuple(context)
        if ids not in self.texts:
            before = self.texts.get(ids[:-1])
            self.texts[ids] = (TOKENIZER.decode(context) if before is None else
                               before + TOKENIZER.decode(context[-1:]))
        return self.texts[ids]

    def next_token(self, context: list[int]) -> int:
        text = self.text(context)
        joins = text.count(JOINED)
        if joins:
            base = text[:text.rindex(JOINED) + len(JOINED)]
            candidates = ([base + self.after[joins - 1]]
                          if joins <= len(self.after) else [])
        else:
            candidates = list(self.scripts)
            if CALLING not in text:
                candidates.append("\n".join(text.split("\n")[:2]) + self.other)
        for script in candidates:
            if script.startswith(text):
                # The first token of the rest (no piece is longer).
                rest = script[len(text):len(text) + LONGEST_PIECE]
                return TOKENIZER.encode(rest)[0] if rest else EOS
        return EOS


class Endless(Exception):
    """A search that sampled more than `MAX_SAMPLED` tokens: one that
    would not end."""


@dataclass
class Bounded:
    """A model that ends a run past `MAX_SAMPLED` tokens (`Endless`)."""

    model: SearchModel
    left: int = MAX_SAMPLED

    def next_token(self, context: list[int]) -> int:
        if not self.left:
            raise Endless(f"past {MAX_SAMPLED} tokens")
        self.left -= 1
        return self.model.next_token(context)


def assert_search_as_the_controller(root: str, model: SearchModel,
                                    max_tokens: int) -> Optional[APRRollout]:
    """The controller's search and the engine's, from the prefix ``root``:
    the same calls (prompt ids), the same answer (the final trace after
    the prompt as the reference shows it, then the EOS that ended its
    last call), the same sub-searches; nothing left behind. Where the
    controller's search never ends (`Endless`: it defines no answer), the
    engine's must. Returns the controller's search, None if it never
    ends."""
    engine = test_apr.SearchEngine(Bounded(model), APR_WINDOW, max_tokens,
                                   APR_LIMITS)
    report = engine.run(root)
    assert_nothing_left(engine.coordinator)
    backend = Recorded(
        ScriptedTextBackend(Bounded(model).next_token, TOKENIZER))
    try:
        [rollout] = run_apr(APRController(BOS, max_tokens), backend, [root])
    except Endless:
        return None
    assert sorted(engine.prompts) == sorted(
        TOKENIZER.encode(prompt) for prompt, _, _ in backend.calls)
    shown = generated(BOS, root, "")
    trace = rollout.trace
    answer = trace[len(shown):] if trace.startswith(shown) else trace
    eos = [EOS] if rollout.calls[-1].token_ids[-1:] == [EOS] else []
    assert list(report.output_token_ids) == TOKENIZER.encode(answer) + eos
    assert [child.text for child in report.tree.children
            ] == [trace for round_ in rollout.rounds for trace in round_]
    return rollout


def assert_nothing_left(coordinator) -> None:
    """No member tracked, parked or counted as a running child."""
    assert coordinator.num_members() == 0
    assert coordinator.num_parked() == 0
    assert coordinator.counts.children_running == 0
    assert coordinator.counts.parents_parked == 0


def apr_model(root: str,
              call: str,
              after: str = apr.CONCLUDES,
              wins: str = apr.WINS,
              fails: str = apr.FAILS) -> SearchModel:
    """`test_apr`'s search from the prefix ``root``: its first call
    ``call``, after the first join ``after``; sub-searches that win with
    ``wins`` or fail with ``fails`` (unknown ones too)."""
    return SearchModel(
        (BOS + root + call, BOS + apr.CHILD_0 + fails, BOS + apr.CHILD_1 +
         wins, BOS + apr.GRANDCHILD_0 + wins, BOS + apr.GRANDCHILD_1 + fails),
        (after, apr.CONCLUDES), fails)


# Calls the reference gives up on (its `call_search` catches any
# exception of reading them) or reads where a stricter reading would not.
MALFORMED_CALLS = {
    # The child's operations are its parent's plus its own: `None + [op]`.
    "operations None": (apr.ROOT.replace("Operations: []",
                                         "Operations: None"), apr.CALL),
    "operations a string": (apr.ROOT.replace("Operations: []",
                                             "Operations: 'x'"), apr.CALL),
    # A dict whose key is a list: unhashable.
    "operations unhashable":
    (apr.ROOT.replace("Operations: []", "Operations: {[1]: 2}"), apr.CALL),
    # The sub-search's prompt joins the node's numbers: an int is none.
    "numbers an int":
    (apr.ROOT, apr.CALL.replace("39:[25, 36, 2] Operation", "39:7 Operation")),
    # Past the parser's stack: MemoryError (RecursionError for fewer).
    "a parser stack overflow":
    (apr.ROOT.replace("Operations: []",
                      "Operations: " + "-" * 7000 + "1"), apr.CALL),
    "a recursion too deep":
    (apr.ROOT.replace("Operations: []",
                      "Operations: " + "-" * 3000 + "1"), apr.CALL),
    # The reference reads a state's numbers up to its second colon: the
    # call goes on.
    "a second colon in the prompt's state":
    (apr.ROOT.replace("51, 49]", "51, 49:7]"), apr.CALL),
    "a second colon in a generated node's state":
    (apr.ROOT,
     apr.CALL.replace("39:[25, 36, 2] Operation",
                      "39:[25, 36, 2]:7 Operation")),
}


@pytest.mark.parametrize("root,call",
                         list(MALFORMED_CALLS.values()),
                         ids=list(MALFORMED_CALLS))
def test_apr_ends_a_malformed_call_as_the_reference(root, call):
    assert_search_as_the_controller(root, apr_model(root, call), 400)


def test_apr_ends_a_search_at_a_call_it_made_before():
    """A call of sub-searches with no `<Calling Sub Searches>`: the
    reference's join cuts the whole trace, its prompt too. After the
    join the root writes its call again; the second join is the first
    one, so the third call is the second one, and so on: the reference
    never ends. The engine ends the search at the call it made before,
    with its trace."""
    listed_alone = apr.GENERATED + apr.LISTED
    # After the join the root describes its node again: the same call.
    model = apr_model(apr.ROOT, listed_alone, after=apr.ROOT + listed_alone)
    # A budget for the whole call after the join.
    budget = 800
    assert assert_search_as_the_controller(apr.ROOT, model, budget) is None
    engine = test_apr.SearchEngine(Bounded(model), APR_WINDOW, budget,
                                   APR_LIMITS)
    report = engine.run(apr.ROOT)
    # Two rounds forked; the third call, the second again, forks none.
    assert len(report.tree.children) == 4
    *output, eos = report.output_token_ids
    assert eos == EOS
    text = TOKENIZER.decode(output)
    assert text.startswith("<Sub Searches>\n")
    assert text.endswith(apr.ROOT + listed_alone.rstrip("\n"))


def rewritten_call(written: str) -> SearchModel:
    """`test_apr`'s search whose root first writes ``written`` (a tag the
    controller rewrites), then its call."""
    model = apr_model(apr.ROOT, written)
    return dataclasses.replace(model,
                               scripts=(*model.scripts,
                                        BOS + apr.ROOT + apr.CALL))


@pytest.mark.parametrize("special", [BOS, BOS * 20])
def test_apr_rewrites_a_written_tag_with_a_special_token_inside(special):
    """The controller's server stops at `<Sub Searches>` in the call's
    text, special tokens skipped: a BOS sampled inside the tag (written
    character by character) leaves it whole there, and so must the
    engine's reading, however many tokens the tag then spans."""
    written = apr.GENERATED + f"<Sub Sea{special}rches>\n" + apr.LISTED
    assert_search_as_the_controller(apr.ROOT, rewritten_call(written), 400)


def test_apr_rewrites_a_written_tag_that_ends_the_call_s_budget():
    """The token that completes `<Sub Searches>` is the call's last: vLLM
    ends the call at its budget and its frontend then finds the stop
    string, which it reports (finish "stop"), so the controller rewrites
    it and decodes on; no `sampled` event comes for a token that ends its
    member, so the engine must find it in the call's end."""
    written = apr.GENERATED + "<Sub Searches>\n" + apr.LISTED
    budget = len(TOKENIZER.encode(apr.GENERATED + "<Sub Searches>"))
    assert_search_as_the_controller(apr.ROOT, rewritten_call(written), budget)


@FUZZ
@given(root=mutated(apr.ROOT, APR_TAGS, APR_SWAPS),
       call=mutated(apr.CALL, APR_TAGS, APR_SWAPS),
       after=st.sampled_from([
           apr.CONCLUDES, apr.SECOND_CALL
       ]).flatmap(lambda text: mutated(text, APR_TAGS, APR_SWAPS)),
       wins=mutated(apr.WINS, APR_TAGS, APR_SWAPS),
       other=mutated(apr.FAILS, APR_TAGS, APR_SWAPS),
       max_tokens=st.just(400) | st.integers(1, 400))
def test_apr_fuzzed_searches_answer_as_the_controller(root, call, after, wins,
                                                      other, max_tokens):
    rollout = assert_search_as_the_controller(
        root, apr_model(root, call, after, wins, other), max_tokens)
    # What the search reached (pytest --hypothesis-show-statistics).
    event("APR: the controller's search never ends" if rollout is
          None else f"APR: {len(rollout.rounds)} rounds, "
          f"{min(len(rollout.calls), 6)} calls (6: or more), "
          f"gave up: {bool(rollout.error)}")


# ThreadWeaver: the test engine and tokenizer of `test_threadweaver` (its
# tags and `<eos>` one token each, every other character one token).
TW_TOKENIZER, TW_EOS = tw_test.TOKENIZER, tw_test.EOS
TW_OPEN, TW_CLOSE = TW_TOKENIZER.encode("<Thread></Thread>")
TW_FRAGMENTS = [
    "<Outlines>", "</Outlines>", "<Outline>", "</Outline>", "<Outline>1:",
    "<Outline>2: b</Outline>\n", "<Outline>1: again</Outline>\n",
    "<Outline>7: unknown</Outline>\n", "<Outline>1.2.3.4.5.6.7.8.9:",
    "<Outline>99999999999999999999999: big</Outline>\n", "<Outline> 3 :",
    "<Outline>٣: arabic</Outline>\n", "<Outline>1", "<Outline>a: x",
    "</Outlines", "<Outlines", "</Thread", "<Thread>", "</Thread>",
    "<Thread>\n1:", "<Parallel>", "</Parallel>", "<Conclusion>",
    "</Conclusion>", "<Think>", "<eos>", ":", "\n", " ", *NON_ASCII
]
TW_SWAPS = [
    "1: a=>1: a</Outline>\n<Outline>1: a", "2: b=>7: b", "2: b=>1.1: b",
    "</Outlines>=></Outlines", "</Outlines>=><Outlines>",
    "<Outline>2=><Outline>٢", "</Thread>=></Thread", "</Thread>=><eos>",
    "</Thread>=></Outlines>"
]
TW_OUTLINES = ("<Parallel>\n<Outlines>\n<Outline>1: a</Outline>\n"
               "<Outline>2: b</Outline>\n</Outlines>")
TW_LIMITS = {
    "max_children_per_sequence": 1000,
    "max_children_per_request": 1000
}


@dataclass
class ThreadModel:
    """Greedy decoding of scripts: a thread (its context's last `<Thread>`
    not closed) writes its label's script after its header (``other``
    for a label no script has, or no header), the root writes ``root``
    with every joined thread left out of its context. Past a script's
    end, or off it: EOS."""

    prompt_len: int
    root: str
    threads: dict[str, str]
    other: str

    def next_token(self, context: list[int]) -> int:
        ids = context[self.prompt_len:]
        opened = max((i for i, t in enumerate(ids) if t == TW_OPEN),
                     default=-1)
        closed = max((i for i, t in enumerate(ids) if t == TW_CLOSE),
                     default=-1)
        if opened > closed:
            text = TW_TOKENIZER.decode(ids[opened:])
            header = tw_scripts.OPEN_THREAD.match(text)
            script = self.other if header is None else self.threads.get(
                header.group(1), self.other)
            done = text if header is None else text[header.end():]
        else:
            script = self.root
            done = tw_scripts.THREADS.sub("", TW_TOKENIZER.decode(ids))
        script_ids, done_ids = (TW_TOKENIZER.encode(script),
                                TW_TOKENIZER.encode(done))
        if script_ids[:len(done_ids)] != done_ids or len(done_ids) >= len(
                script_ids):
            return TW_EOS
        return script_ids[len(done_ids)]


def assert_threads_as_the_controller(prompt_text: str,
                                     model: ThreadModel,
                                     room: int,
                                     budget: Optional[int],
                                     seed: Optional[int],
                                     stops: str = "") -> Optional[tw.Rollout]:
    """The controller's answer and the engine's, token for token, with a
    window ``room`` tokens past the prompt and the request's own stop ids
    ``stops`` (one character each); where the controller has no answer (a
    thread with no room left: its server refuses the call), the engine's
    stays within the window and the budget. Returns the controller's
    answer, None where it has none."""
    prompt = TW_TOKENIZER.encode(prompt_text)
    window = len(prompt) + room
    stop_ids = tuple(TW_TOKENIZER.encode(stops))
    controller = tw.ThreadWeaverController(TW_TOKENIZER,
                                           response_length=budget)
    try:
        [[expected]
         ] = tw.run(controller,
                    ScriptedBackend(model.next_token, TW_EOS, window),
                    [prompt], {
                        "temperature": 0.0,
                        "stop_token_ids": list(stop_ids)
                    } if stop_ids else None)
    except ValueError as error:
        assert "leaves no room" in str(error)
        expected = None
    engine = tw_test.ThreadEngine(model, window, budget, TW_LIMITS, seed,
                                  stop_ids)
    got = engine.run(prompt)
    if expected is None:
        assert len(prompt) + len(got) <= window
        assert budget is None or len(got) <= budget
    else:
        assert got == expected.token_ids
        assert [a.label for a in engine.actions if isinstance(a, Fork)] == [
            b.label for fork in expected.forks for b in fork.branches
        ]
    assert_nothing_left(engine.coordinator)
    return expected


@FUZZ
@given(prompt=mutated("Q: 2*3*4?\n", TW_FRAGMENTS, TW_SWAPS),
       root=st.sampled_from([
           TW_OUTLINES + "\n</Parallel>\nA: 24<eos>", TW_OUTLINES + "\nmid " +
           TW_OUTLINES[len("<Parallel>\n"):] + "\nend<eos>"
       ]).flatmap(lambda text: mutated(text, TW_FRAGMENTS, TW_SWAPS)),
       first=mutated(" 2*3=6\n</Thread>", TW_FRAGMENTS, TW_SWAPS),
       second=mutated(" 6*4=24\n</Thread>", TW_FRAGMENTS, TW_SWAPS),
       other=mutated(" x</Thread>", TW_FRAGMENTS, TW_SWAPS),
       room=st.integers(1, 240),
       budget=st.none() | st.integers(1, 150),
       seed=st.sampled_from([None, 7]),
       stops=st.sampled_from(["", ":", "=\n", "A"]))
def test_threadweaver_fuzzed_answers_are_the_controllers(
        prompt, root, first, second, other, room, budget, seed, stops):
    model = ThreadModel(len(TW_TOKENIZER.encode(prompt)), root, {
        "1": first,
        "2": second
    }, other)
    expected = assert_threads_as_the_controller(prompt, model, room, budget,
                                                seed, stops)
    event("ThreadWeaver: a thread with no room" if expected is None else
          f"ThreadWeaver: {len(expected.forks)} forks, {expected.ended}")


# Promise/sync: `FakeEngine` (the coordinator behind it) and the contract
# (`ReferenceEngine`), fed the same scripted members.
PS_TEXT = st.text(max_size=4).map(lambda s: [OFFSET + ord(c) for c in s])
PS_HOOKS = st.sampled_from([[PROMISE], [SYNC], [ROLE], [PROMISE, SYNC]])
# A member's own tokens: characters of any script and hook tokens, never
# a hook tag spelled in characters (see the module's docstring).
PS_SCRIPT = st.lists(PS_HOOKS | PS_TEXT,
                     max_size=8).map(lambda parts: sum(parts, []))
# A prompt may hold anything: hook tokens and their tags spelled.
PS_PROMPT = st.lists(
    PS_HOOKS | PS_TEXT
    | st.sampled_from(["<promise>", "<sync>", "<child>", "<promise"
                       ]).map(lambda s: [OFFSET + ord(c) for c in s]),
    min_size=1,
    max_size=6).map(lambda parts: sum(parts, [])).filter(bool)


def script_of(member_id: str, roots: list[list[int]],
              children: list[list[int]]) -> list[int]:
    """A member's script: its request's root script, or for the k-th
    child of a tree (`<root>/promise-<k>`) ``children[k % len]``."""
    root, _, child = member_id.partition("/promise-")
    if not child:
        return roots[int(root.split("-")[1])]
    return children[int(child) % len(children)]


def assert_engines_agree(engine: FakeEngine,
                         reference: ReferenceEngine) -> None:
    """What the engine holds, and the coordinator's actions so far, as the
    contract says (as `test_coordinator_state_machine` compares them)."""
    assert engine.live() == reference.live()
    for member_id in engine.live():
        assert (engine.members[member_id].tokens ==
                reference.nodes[member_id].tokens), member_id
    assert {i
            for i, m in engine.members.items()
            if m.parked} == reference.parked()
    assert engine.forks == reference.forks
    assert [(i, r.seed) for i, r in engine.resumes] == reference.resume_seeds
    assert engine.aborts == reference.aborts
    assert {
        root: tree.to_dict()
        for root, tree in engine.reports.items()
    } == reference.reports


@FUZZ
@given(prompts=st.lists(PS_PROMPT, min_size=1, max_size=3),
       roots=st.lists(PS_SCRIPT, min_size=3, max_size=3),
       children=st.lists(PS_SCRIPT, min_size=1, max_size=4),
       max_tokens=st.none() | st.integers(1, 12) | st.just(10**30),
       seed=st.none() | st.integers(-(2**80), 2**80),
       max_model_len=st.integers(16, 64),
       depth=st.integers(1, 3),
       reseeds=st.booleans(),
       show_hooks=st.booleans(),
       logprobs=st.booleans())
def test_promise_sync_fuzzed_trees_follow_the_contract(prompts, roots,
                                                       children, max_tokens,
                                                       seed, max_model_len,
                                                       depth, reseeds,
                                                       show_hooks, logprobs):
    limits = {"max_depth": depth}
    engine = FakeEngine(limits, max_model_len, reseeds, show_hooks)
    reference = ReferenceEngine(limits, max_model_len, reseeds)
    sampled: dict[str, int] = {}
    for i, prompt in enumerate(prompts):
        prompt = prompt[:max_model_len - 1]
        params = RequestParams(len(prompt), max_tokens, seed=seed)
        for side in (engine, reference):
            side.add_request(f"req-{i}", prompt, params, logprobs)
    # Each step every runnable member samples its script's next token or
    # stops; then every stopped member is reported. Scripts are finite and
    # a parked member's children run: a step without either is a hang.
    while reference.live():
        runnable = reference.runnable()
        assert runnable, f"no member can go on: {sorted(reference.live())}"
        for member_id in runnable:
            script = script_of(member_id, roots, children)
            at = sampled.get(member_id, 0)
            if at == len(script) or not reference.has_room(member_id):
                reason = "stop" if at == len(script) else "length"
                engine.stop(member_id, reason)
                reference.stop(member_id, reason)
                continue
            sampled[member_id] = at + 1
            engine.sample(member_id, script[at])
            reference.sample(member_id, script[at])
            assert_engines_agree(engine, reference)
        for member_id in sorted(i for i in reference.live()
                                if reference.nodes[i].stopped):
            engine.report(member_id)
            reference.report(member_id)
            assert_engines_agree(engine, reference)
    assert_nothing_left(engine.coordinator)
    event(f"promise/sync forks: {min(len(engine.forks), 4)}+, merges: "
          f"{min(len(engine.resumes), 2)}+, aborts: {bool(engine.aborts)}")
