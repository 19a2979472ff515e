# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""APR's format on the lifecycle (`APRPolicy`) against APR's own
controller (the test kit's `APRController`), with one scripted model
behind both: the same calls, token for token, and the same traces.

The model continues scripted texts. The controller decodes it over text
calls, as over stock vLLM's completions API (a prompt tokenized anew each
call, the stop string `<Sub Searches>`); the in-engine side decodes it in
`SearchEngine`, which carries out the coordinator's actions on token
lists (a fresh fork starts a member, a restart replaces a member's call).

The tokenizer merges ``"]\\n"`` and the tags into single tokens, so the
re-tokenized trace differs from the tokens a call sampled: the engine
must send what the controller sends, not what it sampled.
"""

import sys
from dataclasses import dataclass, field
from typing import Optional

import pytest
from fake_engine import OFFSET, FakeLogprob, piece_ids

from sequence_hooks.actions import (Abort, Action, Fork, MemberResult,
                                    ReportTree, RequestParams, Restart,
                                    StartTree)
from sequence_hooks.formats.apr import CALLING, call_trace, child_budget
from sequence_hooks.lifecycle import Coordinator
from sequence_hooks.special_kwargs import SpecialKwargs
from sequence_hooks.training_records import training_records
from sequence_hooks_references.formats.apr_controller import (APRController,
                                                              TextCompletion,
                                                              run_apr)
# yapf conflicts with isort for this import
# yapf: disable
from sequence_hooks_testkit.formats.apr_scripts import (CALL, CHILD_0, CHILD_1,
                                                        CONCLUDES, FAILS,
                                                        GENERATED,
                                                        GRANDCHILD_0,
                                                        GRANDCHILD_1, LISTED,
                                                        ROOT, SECOND_CALL,
                                                        WINS)

# yapf: enable

SPECIAL = ("<s>", "</s>")
MERGED = ("<End Calling Sub Searches>", "<Calling Sub Searches>",
          "<End Sub Searches>", "<Sub Searches>", "]\n")
BOS, EOS_TEXT = SPECIAL


class MergingTokenizer:
    """BOS and EOS special; the tags and ``"]\\n"`` one token each
    (but those ``unmerged``), longest first; every other character one
    token."""

    bos_token = BOS
    eos_token_id = 1

    def __init__(self, unmerged: tuple[str, ...] = ()):
        self.pieces = sorted(
            (p for p in SPECIAL + MERGED if p not in unmerged),
            key=len,
            reverse=True)

    def __len__(self) -> int:
        return OFFSET + 0x250

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        return piece_ids(text, self.pieces, SPECIAL + MERGED)

    def convert_ids_to_tokens(self, ids: list) -> list:
        return [self._piece(i) for i in ids]

    def _piece(self, token_id: int) -> str:
        if token_id < OFFSET:
            return (SPECIAL + MERGED + ("", ) * OFFSET)[token_id]
        return chr(token_id - OFFSET)

    def decode(self, ids: list, skip_special_tokens: bool = False) -> str:
        return "".join(
            self._piece(i) for i in ids
            if not (skip_special_tokens and i < len(SPECIAL)))


TOKENIZER = MergingTokenizer()
EOS = TOKENIZER.eos_token_id

AFTER = CONCLUDES
JOINED = "<End Sub Searches>\n"


@dataclass
class ScriptedModel:
    """Greedy decoding of fixed texts. After a join (the context's text,
    BOS off, holds `<End Sub Searches>`) the root writes ``after``, and
    after a k-th join (k > 1) ``later[k - 2]``; otherwise the first script
    the text begins goes on with its next token (the tokenizer's first of
    the rest). At a script's end: EOS."""

    scripts: list[str]
    after: str = AFTER
    later: tuple[str, ...] = ()

    def next_token(self, context: list[int]) -> int:
        text = TOKENIZER.decode(context, skip_special_tokens=True)
        if JOINED in text:
            base = text[:text.rindex(JOINED) + len(JOINED)]
            joins = text.count(JOINED)
            candidates = [
                base + (self.after if joins == 1 else self.later[joins - 2])
            ]
        else:
            candidates = self.scripts
        for script in candidates:
            if script.startswith(text):
                rest = script[len(text):]
                return TOKENIZER.encode(rest)[0] if rest else EOS
        return EOS


class ScriptedServer:
    """Stock vLLM's completions API as the controller sees it: a text
    prompt tokenized, decoded greedily to EOS, ``max_tokens`` or a stop
    string (its text left out). Records every call's prompt ids."""

    def __init__(self, model: ScriptedModel):
        self.model = model
        self.prompts: list[list[int]] = []

    def generate_text(self, prompts, params):
        done = []
        for prompt, one in zip(prompts, params):
            context = TOKENIZER.encode(prompt)
            self.prompts.append(list(context))
            tokens, reason, matched = [], "length", None
            while len(tokens) < one["max_tokens"]:
                token = self.model.next_token(context)
                context.append(token)
                tokens.append(token)
                if token == EOS:
                    reason = "stop"
                    break
                text = TOKENIZER.decode(tokens, skip_special_tokens=True)
                hit = [s for s in one["stop"] if s in text]
                if hit:
                    reason, matched = "stop", hit[0]
                    break
            text = TOKENIZER.decode(tokens, skip_special_tokens=True)
            if matched is not None:
                text = text[:text.index(matched)]
            done.append(TextCompletion(text, reason, matched))
        return done


def model_logprob(context: list[int], token: int) -> float:
    """The logprob the scripted model gives ``token`` after exactly
    ``context`` (another context, another value)."""
    return -(hash((*context, token)) % 1000 + 1) / 1000


@dataclass
class Call:
    tokens: list[int]
    start: int
    max_tokens: Optional[int]
    # Per sampled token, its logprobs (in `CompletionOutput`'s form).
    logprobs: list = field(default_factory=list)


@dataclass
class SearchEngine:
    """Carries out the coordinator's actions on token lists, one token per
    live member a step, with vLLM's stop checks (EOS: "stop"; the budget
    or the model length: "length"; no event for a token that ends its
    member). Records every call's prompt ids; with ``logprobs``, gives the
    sampled tokens' logprobs as a request that asked for them."""

    model: ScriptedModel
    max_model_len: int
    max_tokens: Optional[int]
    limits: dict = field(default_factory=dict)
    logprobs: bool = False

    def __post_init__(self):
        special_kwargs = SpecialKwargs(format="apr", **self.limits)
        self.coordinator = Coordinator.for_format(special_kwargs,
                                                  self.max_model_len,
                                                  TOKENIZER,
                                                  clock=lambda: 0.0)
        self.calls: dict[str, Call] = {}
        self.prompts: list[list[int]] = []
        self.actions: list[Action] = []

    def run(self, prefix: str) -> ReportTree:
        prompt = TOKENIZER.encode(BOS + prefix)
        self.carry_out(
            self.coordinator.arrived(
                "root", prompt, RequestParams(len(prompt), self.max_tokens)))
        self.start("root", prompt, self.max_tokens)
        while self.calls:
            ended = []
            for member_id in list(self.calls):
                call = self.calls.get(member_id)
                if call is None:
                    continue
                # No call runs for a member the lifecycle has ended.
                assert self.coordinator.is_member(member_id)
                assert not self.coordinator.is_finished(member_id)
                token = self.model.next_token(call.tokens)
                call.logprobs.append(
                    {token: FakeLogprob(model_logprob(call.tokens, token), 1)})
                call.tokens.append(token)
                own = len(call.tokens) - call.start
                if token == EOS:
                    ended.append((member_id, "stop"))
                elif (len(call.tokens) >= self.max_model_len or
                      call.max_tokens is not None and own >= call.max_tokens):
                    ended.append((member_id, "length"))
                else:
                    self.carry_out(
                        self.coordinator.sampled(
                            member_id, call.tokens, lambda: None,
                            self.sampled_logprobs(member_id, call)))
            for member_id, reason in ended:
                call = self.calls.pop(member_id)
                own = call.tokens[call.start:]
                self.carry_out(
                    self.coordinator.finished(
                        member_id, reason,
                        MemberResult(
                            own, TOKENIZER.decode(own,
                                                  skip_special_tokens=True),
                            self.sampled_logprobs(member_id, call))))
        [report] = [a for a in self.actions if isinstance(a, ReportTree)]
        return report

    def start(self, member_id: str, prompt: list[int],
              max_tokens: Optional[int]) -> None:
        self.prompts.append(list(prompt))
        self.calls[member_id] = Call(list(prompt), len(prompt), max_tokens)

    def carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            self.actions.append(action)
            if isinstance(action, StartTree):
                assert action.holds_output
            elif isinstance(action, Fork):
                assert action.fresh
                self.start(action.request_id, list(action.context_tokens),
                           action.max_tokens)
            elif isinstance(action, Restart):
                self.calls.pop(action.member_id, None)
                self.start(action.member_id, list(action.prompt_token_ids),
                           self.max_tokens)
            elif isinstance(action, Abort):
                for member_id in action.member_ids:
                    # A call that ended here already is skipped.
                    self.calls.pop(member_id, None)
            else:
                assert isinstance(action, ReportTree), action

    def sampled_logprobs(self, member_id: str, call: Call) -> Optional[list]:
        """A call's sampled tokens' logprobs so far, if asked for."""
        return list(call.logprobs) if self.logprobs else None


def both(model: ScriptedModel,
         max_tokens: int = 400,
         max_model_len: int = 2048,
         limits: Optional[dict] = None,
         root: str = ROOT,
         logprobs: bool = False):
    """The controller's search and the engine's, on the same model, from
    the prefix ``root``."""
    server = ScriptedServer(model)
    [rollout] = run_apr(APRController(BOS, max_tokens), server, [root])
    engine = SearchEngine(model, max_model_len, max_tokens, limits or {},
                          logprobs)
    report = engine.run(root)
    return rollout, server, engine, report


def assert_same(rollout, server, engine, report, root: str = ROOT) -> None:
    """The same calls (prompt ids) and the same final trace after
    ``root``; the tree holds each sub-search's final trace."""
    assert sorted(engine.prompts) == sorted(server.prompts)
    # The output ends with the EOS that ended the last call, as a stock
    # request's does.
    *output, last = report.output_token_ids
    assert last == EOS
    assert TOKENIZER.decode(output) == rollout.trace[len(root):]
    assert [child.text for child in report.tree.children
            ] == [trace for round_ in rollout.rounds for trace in round_]


def test_children_start_fresh_and_join_into_the_cut_back_root():
    rollout, server, engine, report = both(
        ScriptedModel([ROOT + CALL, CHILD_0 + FAILS, CHILD_1 + WINS]))
    assert_same(rollout, server, engine, report)
    assert rollout.answer == "36-25=11 Goal Reached"
    assert len(rollout.rounds) == 1 and len(rollout.calls) == 4
    forks = [a for a in engine.actions if isinstance(a, Fork)]
    assert [f.label for f in forks] == ["#0,0", "#0,1"]
    assert [TOKENIZER.decode(list(f.context_tokens))
            for f in forks] == [BOS + CHILD_0, BOS + CHILD_1]
    [restart] = [a for a in engine.actions if isinstance(a, Restart)]
    joined = TOKENIZER.decode(list(restart.prompt_token_ids))
    assert joined.startswith(BOS + ROOT + GENERATED + "<Sub Searches>\n")
    assert "<No Solution in Sub Search 0 at level 1 at Node #0,0>" in joined
    assert "<Goal Reached in Sub Search 1 at level 1 at Node #0,1>" in joined
    assert "<Calling Sub Searches>" not in joined


def test_the_join_is_re_tokenized_as_the_controller_sends_it():
    """The root's first call sampled ``"]"`` and ``"\n"`` apart; its
    re-sent trace merges them: the engine sends the merged ids."""
    model = ScriptedModel([ROOT + CALL, CHILD_0 + FAILS, CHILD_1 + WINS])
    rollout, server, engine, report = both(model)
    first = TOKENIZER.encode(BOS + ROOT)
    assert TOKENIZER.decode(first).endswith("[]")
    [restart] = [a for a in engine.actions if isinstance(a, Restart)]
    resent = list(restart.prompt_token_ids)
    assert resent[:len(first)] != first
    assert resent[len(first) - 1] == TOKENIZER.encode("]\n")[0]
    assert resent in server.prompts


def test_a_written_sub_searches_tag_is_rewritten_as_the_controller_does():
    written = GENERATED + "<Sub Searches>\n" + LISTED
    rollout, server, engine, report = both(
        ScriptedModel(
            [ROOT + written, ROOT + CALL, CHILD_0 + FAILS, CHILD_1 + WINS]))
    assert_same(rollout, server, engine, report)
    assert len(rollout.calls) == 5
    restarts = [a for a in engine.actions if isinstance(a, Restart)]
    assert TOKENIZER.decode(list(
        restarts[0].prompt_token_ids)) == (BOS + ROOT + GENERATED +
                                           "<Calling Sub Searches>")


def test_a_sub_search_cut_at_max_tokens_has_no_solution():
    long_search = "\n" + "Exploring Operation: 51+11=62\n" * 12 + WINS
    model = ScriptedModel(
        [ROOT + CALL, CHILD_0 + FAILS, CHILD_1 + long_search])
    max_tokens = len(TOKENIZER.encode(CALL)) + 2
    assert len(TOKENIZER.encode(long_search)) > max_tokens
    rollout, server, engine, report = both(model, max_tokens=max_tokens)
    assert_same(rollout, server, engine, report)
    assert [c.finish_reason
            for c in report.tree.children] == ["stop", "length"]
    [restart] = [a for a in engine.actions if isinstance(a, Restart)]
    assert "No Solution in Sub Search 1" in TOKENIZER.decode(
        list(restart.prompt_token_ids))


def test_a_call_listing_no_child_joins_at_once():
    empty = GENERATED + "<Calling Sub Searches>\n<End Calling Sub Searches>\n"
    rollout, server, engine, report = both(ScriptedModel([ROOT + empty]))
    assert_same(rollout, server, engine, report)
    assert not [a for a in engine.actions if isinstance(a, Fork)]
    assert "<Sub Searches>\n<End Sub Searches>\n" in rollout.trace


@pytest.mark.parametrize("listed", ["#0,7", "#0,"])
def test_a_malformed_call_ends_the_search_with_its_trace(listed):
    bad = (GENERATED + "<Calling Sub Searches>\n<Start Sub Search 0 at "
           f"level 1> Moving to Node {listed}\n<End Calling Sub Searches>\n")
    rollout, server, engine, report = both(ScriptedModel([ROOT + bad]))
    assert rollout.error and rollout.answer is None
    assert_same(rollout, server, engine, report)
    assert report.tree.finish_reason == "stop"
    assert not report.tree.children


# A state that does not parse, in the root's prompt and in a node the
# call lists: the reference's `eval` raises, its `except` ends the search.
BAD_STATE_ROOT = ROOT.replace("49], Operations", "49 Operations")
BAD_STATE_NODE = CALL.replace("39:[25, 36, 2] Operation", "39:[25, 36, 2 "
                              "Operation")


@pytest.mark.parametrize("root,script", [(BAD_STATE_ROOT, CALL),
                                         (ROOT, BAD_STATE_NODE)],
                         ids=["in the prompt", "in a listed node"])
def test_a_malformed_current_state_ends_the_search_with_its_trace(
        root, script):
    rollout, server, engine, report = both(ScriptedModel([root + script]),
                                           root=root)
    assert rollout.error and rollout.answer is None
    assert_same(rollout, server, engine, report, root)
    assert report.tree.finish_reason == "stop"
    assert not report.tree.children


def test_children_past_the_limit_have_no_solution():
    """The one difference from the controller (docs/formats.md): a call
    forks at most `max_children_per_sequence` children."""
    model = ScriptedModel([ROOT + CALL, CHILD_0 + FAILS, CHILD_1 + WINS])
    _, _, engine, report = both(model, limits={"max_children_per_sequence": 1})
    assert len(report.tree.children) == 1
    [restart] = [a for a in engine.actions if isinstance(a, Restart)]
    assert "<No Solution in Sub Search 1 at level 1 at Node #0,1>" in (
        TOKENIZER.decode(list(restart.prompt_token_ids)))
    [start] = [a for a in engine.actions if isinstance(a, StartTree)]
    assert start.tree.num_refused == 1


def test_a_join_past_the_context_window_ends_the_root():
    model = ScriptedModel([ROOT + CALL, CHILD_0 + FAILS, CHILD_1 + WINS])
    window = len(TOKENIZER.encode(BOS + ROOT + CALL)) + 4
    _, _, engine, report = both(model, max_model_len=window)
    assert not [a for a in engine.actions if isinstance(a, Restart)]
    assert report.tree.finish_reason == "length"
    text = TOKENIZER.decode(list(report.output_token_ids))
    assert text.endswith("<End Sub Searches>\n")


@pytest.fixture
def calling_in_characters(monkeypatch):
    """A tokenizer with ``<Calling Sub Searches>`` in characters: the
    controller's rewrite is longer than the `<Sub Searches>` it replaces."""
    monkeypatch.setattr(sys.modules[__name__], "TOKENIZER",
                        MergingTokenizer(unmerged=(CALLING, )))


def test_a_rewrite_past_the_context_window_ends_the_member_and_its_call(
        calling_in_characters):
    """The root writes `<Sub Searches>` with room left in the window, but
    its call made anew would not fit: the root ends there, "length", and
    the engine ends the call it is still running."""
    model = ScriptedModel([ROOT + GENERATED + "<Sub Searches>\n" + LISTED])
    call = TOKENIZER.encode(BOS + ROOT + GENERATED + "<Sub Searches>")
    window = len(call) + 3
    assert len(TOKENIZER.encode(BOS + ROOT + GENERATED + CALLING)) > window
    engine = SearchEngine(model, window, 400, logprobs=True)
    report = engine.run(ROOT)
    assert report.tree.finish_reason == "length"
    assert TOKENIZER.decode(list(
        report.output_token_ids)) == GENERATED + CALLING
    # At the tag, with the report: no token of the call after it.
    assert engine.actions[-2:] == [report, Abort(("root", ))]
    assert engine.prompts == [TOKENIZER.encode(BOS + ROOT)]
    assert engine.coordinator.num_members() == 0


def test_a_child_s_rewrite_past_the_context_window_ends_it_and_its_call(
        calling_in_characters):
    """The same for a sub-search: it ends there ("length", no solution)
    and its call with it; the join goes on."""
    window = len(TOKENIZER.encode(BOS + ROOT + CALL)) + 8
    filler = "\n" + "." * (window - 4 -
                           len(TOKENIZER.encode(BOS + CHILD_1 + "\n")))
    model = ScriptedModel([
        ROOT + CALL, CHILD_0 + FAILS,
        CHILD_1 + filler + "<Sub Searches>\n" + LISTED
    ])
    engine = SearchEngine(model, window, 400)
    report = engine.run(ROOT)
    first, second = report.tree.children
    assert (first.finish_reason, second.finish_reason) == ("stop", "length")
    assert second.text.endswith(filler + CALLING)
    assert Abort((second.request_id, )) in engine.actions
    assert len(engine.prompts) == 3 + len(
        [a for a in engine.actions if isinstance(a, Restart)])
    assert engine.coordinator.num_members() == 0


def test_a_second_round_of_sub_searches_joins_as_the_first():
    model = ScriptedModel([
        ROOT + CALL, CHILD_0 + FAILS, CHILD_1 + FAILS, GRANDCHILD_0 + WINS,
        GRANDCHILD_1 + FAILS
    ],
                          after=SECOND_CALL,
                          later=(CONCLUDES, ))
    # Room for the second call's text (a character a token).
    rollout, server, engine, report = both(model, max_tokens=800)
    assert_same(rollout, server, engine, report)
    assert len(rollout.rounds) == 2 and len(rollout.calls) == 7
    forks = [a for a in engine.actions if isinstance(a, Fork)]
    assert [f.label for f in forks] == ["#0,0", "#0,1", "#0,1,0", "#0,1,1"]
    restarts = [a for a in engine.actions if isinstance(a, Restart)]
    last = TOKENIZER.decode(list(restarts[-1].prompt_token_ids))
    # Both joins stay; only the second call is cut out.
    assert last.count("<End Sub Searches>") == 2
    assert "<Goal Reached in Sub Search 0 at level 1 at Node #0,1,0>" in last
    assert last.count("<Calling Sub Searches>") == 0


def test_a_sub_search_s_own_call_is_not_read():
    """One level, as the reference: a child that writes a call of its own
    ends with it in its trace (no solution), and nothing forks from it."""
    nested = ("\nExploring Operation: 51-11=40, Resulting Numbers: [49, 40]"
              "\nGenerated Node #0,1,0: 39:[49, 40] Operation: 51-11=40\n"
              "<Calling Sub Searches>\n<Start Sub Search 0 at level 1> "
              "Moving to Node #0,1,0\n<End Calling Sub Searches>\n")
    model = ScriptedModel(
        [ROOT + CALL, CHILD_0 + FAILS, CHILD_1 + nested, GRANDCHILD_0 + WINS],
        after="No solution found.\n")
    rollout, server, engine, report = both(model)
    assert_same(rollout, server, engine, report)
    assert len(rollout.calls) == 4
    forks = [a for a in engine.actions if isinstance(a, Fork)]
    assert [f.label for f in forks] == ["#0,0", "#0,1"]
    assert report.tree.children[1].text.endswith("<End Calling Sub Searches>")
    [restart] = [a for a in engine.actions if isinstance(a, Restart)]
    assert "<No Solution in Sub Search 1 at level 1 at Node #0,1>" in (
        TOKENIZER.decode(list(restart.prompt_token_ids)))


def given_logprobs(context: list[int], node) -> list[Optional[float]]:
    """A node's logprobs in its tree, each checked to be the one the
    model gives its token after ``context`` and the node's tokens before
    it."""
    ids = list(node.token_ids)
    given = []
    for at, (token, entry) in enumerate(zip(ids, node.logprobs, strict=True)):
        if entry is not None:
            assert entry[token].logprob == model_logprob(
                context + ids[:at], token), (node.label, at)
        given.append(None if entry is None else entry[token].logprob)
    return given


def test_the_tree_keeps_each_token_s_logprob_where_its_call_sampled_it():
    """Logprobs only where a call sampled the node's token after the same
    ids: all the root's but its join's; none of its children's, whose
    traces re-tokenize ``"]\\n"`` across their prompts' end (which no call
    sampled)."""
    root = ROOT + "\n"
    model = ScriptedModel([root + CALL[1:], CHILD_0 + FAILS, CHILD_1 + WINS])
    rollout, server, engine, report = both(model, root=root, logprobs=True)
    assert_same(rollout, server, engine, report, root)
    tree = report.tree
    given = given_logprobs(TOKENIZER.encode(BOS + root), tree)
    [(at, count)] = tree.merged_spans
    assert count > 0
    # And the EOS: the trace drops the empty line the call sampled it
    # after (`ended_trace`).
    assert [i for i, value in enumerate(given)
            if value is None] == [*range(at, at + count),
                                  len(given) - 1]
    assert tree.cumulative_logprob == pytest.approx(
        sum(value for value in given if value is not None))
    assert len(tree.children) == 2
    for child in tree.children:
        assert given_logprobs(TOKENIZER.encode(BOS),
                              child) == [None] * len(child.token_ids)


def test_a_restarted_call_keeps_the_logprobs_its_ids_agree_on():
    """The root's first call writes `<Sub Searches>` (rewritten to a call,
    re-tokenized): its tokens before it keep their logprobs through both
    restarts."""
    root = ROOT + "\n"
    written = GENERATED[1:] + "<Sub Searches>\n" + LISTED
    model = ScriptedModel(
        [root + written, root + CALL[1:], CHILD_0 + FAILS, CHILD_1 + WINS])
    rollout, server, engine, report = both(model, root=root, logprobs=True)
    assert_same(rollout, server, engine, report, root)
    given = given_logprobs(TOKENIZER.encode(BOS + root), report.tree)
    first = len(TOKENIZER.encode(GENERATED[1:]))
    assert None not in given[:first]


def test_without_logprobs_asked_the_tree_has_none():
    _, _, _, report = both(
        ScriptedModel([ROOT + CALL, CHILD_0 + FAILS, CHILD_1 + WINS]))
    assert report.tree.logprobs is None
    assert [c.logprobs for c in report.tree.children] == [None, None]


def test_training_records_refuse_a_format_s_tree():
    """Its children's contexts are fresh prompts the tree does not hold:
    flattened as promise/sync's, each would get its parent's instead."""
    _, _, _, report = both(
        ScriptedModel([ROOT + CALL, CHILD_0 + FAILS, CHILD_1 + WINS]))
    with pytest.raises(ValueError, match="promise/sync trees"):
        training_records(TOKENIZER.encode(BOS + ROOT), report.tree, None)


def test_training_records_train_only_what_was_sampled_after_its_ids():
    """A search that calls nothing is a root alone; its last EOS came
    after an empty line its trace drops: no logprob, not trained."""
    root = ROOT + "\n"
    rollout, server, engine, report = both(ScriptedModel([root + FAILS[1:]]),
                                           root=root,
                                           logprobs=True)
    assert not report.tree.children
    [record] = training_records(TOKENIZER.encode(BOS + root), report.tree,
                                None)
    assert record.token_ids[-1] == EOS
    assert record.sampled_mask == (True, ) * (len(record.token_ids) - 1) + (
        False, )


def test_a_trace_without_a_bos_is_its_text():
    """The reference replaces the BOS sent as text by a space; a tokenizer
    with none sends none, and the text stays as it is (a replace of ""
    would put a space between every two characters)."""
    assert call_trace("", "ab", "c") == "abc"
    assert call_trace(BOS, "ab", "c") == "abc"
    assert call_trace(BOS, "ab", BOS + "c") == "ab c"


def test_a_call_listing_no_node_has_no_budget_to_split():
    assert child_budget(4096, 0, True) == 4096
    assert child_budget(4096, 2, True) == 2048
    assert child_budget(4096, 3, True) == 1536
    assert child_budget(None, 2, True) is None
