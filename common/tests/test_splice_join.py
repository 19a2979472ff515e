# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The splice join's decisions (`SplicePolicy`, NPR's and Multiverse's
formats) on the coordinator, model-free: what each event asks of an
engine, its indices written out by hand from the layout
(docs/formats.md, "Multiverse and NPR")."""

import pytest
from fake_engine import TagTokenizer

from sequence_hooks.actions import (Conclude, Fork, MemberResult, Park,
                                    RequestParams, Resume, Splice, SplicedPath,
                                    StartTree)
from sequence_hooks.formats import SPLICE, format_named, refusal_for
from sequence_hooks.lifecycle import Coordinator
from sequence_hooks.special_kwargs import SpecialKwargs

TAGS = ("<guideline>", "</guideline>", "<plan>", "</plan>", "<step>",
        "</step>", "<takeaway>", "</takeaway>", "<Goal>", "</Goal>",
        "<Outline>", "<Path>", "</Path>", "<Conclusion>", "<eos>")
TOKENIZER = TagTokenizer(TAGS)
ids = TOKENIZER.encode
PROMPT = ids("Q?")
GUIDELINE = ids("<guideline><plan>1: a</plan><plan>2: bb</plan></guideline>")
NEWLINE = ids("\n")


def coordinator(name: str = "npr", **options) -> Coordinator:
    return Coordinator.for_format(SpecialKwargs(format=name,
                                                format_options=options
                                                or None),
                                  1000,
                                  TOKENIZER,
                                  clock=lambda: 0.0)


def params() -> RequestParams:
    return RequestParams(len(PROMPT), None)


def test_goal_forks_one_path_per_plan_positioned_from_its_header():
    hooks = coordinator()
    context = PROMPT + GUIDELINE
    actions = hooks.sampled("r", context, params)
    assert isinstance(actions[0], StartTree)
    forks = actions[1:3]
    assert [fork.context_tokens for fork in forks
            ] == [tuple(ids("\n<step>\n1:")),
                  tuple(ids("\n<step>\n2:"))]
    # The newline keeps its parent's positions, the header moves back one:
    # `<step>` shares the newline's position (G+1).
    assert all(fork.position_shift == (1, -1) for fork in forks)
    assert [fork.label for fork in forks] == ["1", "2"]
    assert actions[3] == Park("r")


def test_a_path_gets_its_newline_then_ends_and_the_join_splices():
    hooks = coordinator()
    context = PROMPT + GUIDELINE
    forks = [
        a for a in hooks.sampled("r", context, params) if isinstance(a, Fork)
    ]
    g = len(context) - 1
    ends = {}
    for fork, body in zip(forks, ("x</step>", "yyy</step>")):
        child = context + list(fork.context_tokens) + ids(body)
        assert hooks.sampled(fork.request_id, child, params) == [
            Resume(fork.request_id, tuple(NEWLINE), 0.0, None)
        ]
        child += NEWLINE + ids("z")
        assert hooks.sampled(fork.request_id, child,
                             params) == [Conclude(fork.request_id, (), 0.0)]
        own = child[len(context) + len(fork.context_tokens):]
        ends[fork.request_id] = (child, own)
    first, second = forks
    assert hooks.finished(first.request_id, "stop",
                          MemberResult(ends[first.request_id][1], None)) == []
    (splice, ) = hooks.finished(second.request_id, "stop",
                                MemberResult(ends[second.request_id][1], None))
    # Path 1 from `</guideline>` (index g) to its newline; path 2 from its
    # `<step>` (g + 2); each anchored at its `</step>`.
    end1 = len(ends[first.request_id][0]) - 1
    end2 = len(ends[second.request_id][0]) - 1
    assert splice == Splice(
        "r", (SplicedPath(first.request_id, g, end1, end1 - 2),
              SplicedPath(second.request_id, g + 2, end2, end2 - 2)),
        tuple(ids("<takeaway>\n")), 0.0)
    tree = hooks.tree_of("r")
    assert [child.token_ids for child in tree.root.children
            ] == [ids("x</step>\n"), ids("yyy</step>\n")]


def test_the_prefill_join_runs_plain_paths_and_computes_their_text():
    """``join: "prefill"``: the paths positioned by their length, the join
    their text after the newline, then `<takeaway>`, all of it computed."""
    hooks = coordinator(join="prefill")
    context = PROMPT + GUIDELINE
    forks = [
        a for a in hooks.sampled("r", context, params) if isinstance(a, Fork)
    ]
    assert [fork.position_shift for fork in forks] == [None, None]
    joins = []
    for fork, body in zip(forks, ("x</step>", "yyy</step>")):
        child = context + list(fork.context_tokens) + ids(body)
        hooks.sampled(fork.request_id, child, params)
        hooks.sampled(fork.request_id, child + NEWLINE + ids("z"), params)
        joins += hooks.finished(fork.request_id, "stop",
                                MemberResult(ids(body + "\nz"), None))
    assert joins == [
        Resume(
            "r",
            tuple(
                ids("\n<step>\n1:x</step>\n<step>\n2:yyy</step>\n"
                    "<takeaway>\n")), 0.0, None)
    ]


def test_an_unknown_join_is_refused_at_start():
    with pytest.raises(ValueError, match="join"):
        coordinator(join="concatenate")


def test_a_path_that_does_not_close_ends_the_answer_with_the_text():
    hooks = coordinator()
    context = PROMPT + GUIDELINE
    forks = [
        a for a in hooks.sampled("r", context, params) if isinstance(a, Fork)
    ]
    hooks.sampled(forks[0].request_id,
                  context + list(forks[0].context_tokens) + ids("x</step>"),
                  params)
    hooks.sampled(forks[0].request_id,
                  context + list(forks[0].context_tokens) + ids("x</step>\nz"),
                  params)
    hooks.finished(forks[0].request_id, "stop",
                   MemberResult(ids("x</step>\nz"), None))
    eos = [TOKENIZER.eos_token_id]
    (conclude, ) = hooks.finished(forks[1].request_id, "stop",
                                  MemberResult(ids("y") + eos, None))
    assert conclude == Conclude(
        "r", tuple(ids("\n<step>\n1:x</step>\n<step>\n2:y") + eos), 0.0)


def test_the_paths_text_is_cut_at_the_models_length():
    """A path that ran to its window ends the answer with the paths' text
    up to the model's length, where decoding them in turn would stop: a
    "length" finish."""
    context = PROMPT + GUIDELINE
    hooks = Coordinator.for_format(SpecialKwargs(format="npr"),
                                   len(context) + 12,
                                   TOKENIZER,
                                   clock=lambda: 0.0)
    forks = [
        a for a in hooks.sampled("r", context, params) if isinstance(a, Fork)
    ]
    hooks.finished(forks[0].request_id, "length",
                   MemberResult(ids("x" * 20), None))
    (conclude, ) = hooks.finished(forks[1].request_id, "length",
                                  MemberResult(ids("y" * 20), None))
    assert conclude == Conclude("r", tuple(ids("\n<step>\n1:xxxxxxx")), 0.0,
                                "length")


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_a_path_ended_after_its_newline_is_closed_whatever_ended_it(reason):
    """The token a path samples after its newline is dropped, and the
    path is closed, whether the format's `Conclude` ended it there or the
    engine did (an EOS, a stop id or string, its length): the join
    splices it, as the published engines ignore an EOS there."""
    hooks = coordinator()
    context = PROMPT + GUIDELINE
    forks = [
        a for a in hooks.sampled("r", context, params) if isinstance(a, Fork)
    ]
    actions = []
    for fork, text in zip(forks, ("x", "yy")):
        path = context + list(fork.context_tokens) + ids(text + "</step>")
        hooks.sampled(fork.request_id, path, params)
        actions = hooks.finished(
            fork.request_id, reason,
            MemberResult(
                ids(text + "</step>\n") + [TOKENIZER.eos_token_id], None))
    (splice, ) = actions
    assert isinstance(splice, Splice)
    assert [p.member_id for p in splice.paths] == [f.request_id for f in forks]


def test_npr_paths_do_not_fork_multiverse_paths_do():
    for name, goal, nests in (("npr",
                               ids("<guideline><plan>1: a</plan>"
                                   "</guideline>"), False),
                              ("multiverse", ids("<Goal><Outline>1: a</Goal>"),
                               True)):
        hooks = coordinator(name)
        context = PROMPT + goal
        (fork, ) = [
            a for a in hooks.sampled("r", context, params)
            if isinstance(a, Fork)
        ]
        child = context + list(fork.context_tokens) + goal
        forked = [
            a for a in hooks.sampled(fork.request_id, child, params)
            if isinstance(a, Fork)
        ]
        assert bool(forked) is nests


def test_a_goal_without_labels_decodes_on():
    hooks = coordinator()
    context = PROMPT + ids("<guideline>no plan</guideline>")
    assert hooks.sampled("r", context,
                         params) == [StartTree("r", hooks.tree_of("r"))]


@pytest.mark.parametrize("name", ["npr", "multiverse"])
def test_an_engine_without_splice_refuses_them(name):
    reason = refusal_for(format_named(name), frozenset({"fork"}))
    assert SPLICE in reason
