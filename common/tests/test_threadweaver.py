# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ThreadWeaver's format on the lifecycle (`ForkJoinPolicy` with
`ThreadWeaverFormat`) against ThreadWeaver's own controller (the test
kit's `ThreadWeaverController`), with one scripted model behind both:
token for token the same answer, model-free.

The model (`threadweaver_scripts`) writes a root script and, in a thread,
its label's script. The controller decodes it call by call, as over stock
vLLM; the in-engine side decodes it in `ThreadEngine` (`call_engine`),
which carries out the coordinator's actions (a fork copies the context
and adds the header, a park waits, a resume appends, a conclude ends)
and stops a member as vLLM's stop checks do.
"""

import dataclasses
from typing import Optional

import pytest
from call_engine import CallEngine
from fake_engine import TagTokenizer

from sequence_hooks.actions import (Action, Fork, Park, ReportTree, Restart,
                                    Resume, StartTree)
from sequence_hooks.fork_join import BranchResult
from sequence_hooks.formats.threadweaver import ThreadWeaverFormat
from sequence_hooks.special_kwargs import SpecialKwargs
from sequence_hooks_references.formats import threadweaver_controller as tw
from sequence_hooks_references.formats.backends import ScriptedBackend
from sequence_hooks_testkit.formats import threadweaver_scripts as scripts

TAGS = ("<Think>", "</Think>", "<Parallel>", "</Parallel>", "<Outlines>",
        "</Outlines>", "<Outline>", "</Outline>", "<Thread>", "</Thread>",
        "<Conclusion>", "</Conclusion>", "<eos>")
# ThreadWeaver's tags (and `<eos>`) one token each, every other character
# one token: the tokenizer both sides share.
TOKENIZER = TagTokenizer(TAGS)
EOS = TOKENIZER.eos_token_id
PROMPT_TEXT = "Q: 2*3*4?\n"


def scripted(
        root: str,
        threads: Optional[dict[str, str]] = None) -> scripts.ScriptedModel:
    """The scripted model on this tokenizer, after `PROMPT_TEXT`."""
    return scripts.ScriptedModel(TOKENIZER, PROMPT_TEXT, root, threads or {})


class ThreadEngine(CallEngine):
    """`CallEngine` with the RL controller's policy: a thread's budget is
    the window's, and a call made anew (`Restart`) continues the root's
    ids with the join.

    Args:
        model: The scripted model.
        max_model_len: The model length.
        max_tokens: The request's budget.
        limits: More `SpecialKwargs` fields.
        seed: The request's seed.
        stop_token_ids: The request's own stop ids.
    """

    def __init__(self,
                 model: scripts.ScriptedModel,
                 max_model_len: int,
                 max_tokens: Optional[int],
                 limits: dict,
                 seed: Optional[int] = None,
                 stop_token_ids: tuple[int, ...] = ()):
        super().__init__(model, TOKENIZER,
                         SpecialKwargs(format="threadweaver", **limits),
                         max_model_len, max_tokens, seed, stop_token_ids)

    def carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Fork):
                assert action.max_tokens is None
            elif isinstance(action, Restart):
                # The root's whole context so far, then the join it shows.
                shown = len(action.shown_token_ids)
                assert action.prompt_token_ids[:-shown or None] == tuple(
                    self.prompt + self.output)
            super().carry_out([action])


PROMPT = TOKENIZER.encode(PROMPT_TEXT)
OUTLINES = ("<Parallel>\n<Outlines>\n<Outline>1: a</Outline>\n"
            "<Outline>2: b</Outline>\n</Outlines>")
CASES = {
    "several outlines":
    scripted(OUTLINES + "\n</Parallel>\nA: 24<eos>", {
        "1": " 2*3=6\n</Thread>",
        "2": " 6*4=24\n</Thread>"
    }),
    "a repeated label":
    scripted(
        "<Outlines>\n<Outline>1: a</Outline>\n"
        "<Outline>1: again</Outline>\n<Outline>3: c</Outline>\n</Outlines>"
        "\nok<eos>", {
            "1": " one</Thread>",
            "3": " three</Thread>"
        }),
    "a thread that hits EOS":
    scripted(OUTLINES + "\nnever", {
        "1": " done<eos>",
        "2": " fine</Thread>"
    }),
    "a thread that hits the window":
    scripted(OUTLINES + "\nnever", {
        "1": " short</Thread>",
        "2": " " + "x" * 200
    }),
    "no outline":
    scripted("just an answer<eos>"),
    "an outline with no label":
    scripted("<Outlines>\n<Outline>a: no number</Outline>\n</Outlines>"
             " then on<eos>"),
    "two rounds":
    scripted(
        OUTLINES + "\nmid " + OUTLINES.replace("<Parallel>\n", "") +
        "\nend<eos>", {
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
    model = scripted(rounds + "end<eos>", {
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


@pytest.mark.parametrize("stop,seed,max_steps,budget", [
    ("A", None, 32, None),
    (":", None, 32, None),
    (":", 7, 32, None),
    ("=", None, 32, None),
    (":", None, 3, None),
    (":", None, 32, 40),
])
def test_a_requests_own_stop_makes_the_next_call_as_the_controller(
        stop, seed, max_steps, budget):
    """The controller merges the request's stop ids into its calls'. A
    sequential call that ends at one (neither EOS nor length) is followed
    by another from the whole context, counted as a step; a thread that
    ends at one gets its closure. The engine makes the same calls, so the
    same answer: "A" after the join, ":" in the outlines before the fork
    (seeded or not, up to the step limit or the budget), "=" in a
    thread."""
    model = CASES["several outlines"]
    stop_id = TOKENIZER.encode(stop)[0]
    window = 200
    backend = ScriptedBackend(model.next_token, EOS, window)

    def both(stop_ids: tuple[int, ...]) -> tuple[tw.Rollout, ThreadEngine]:
        controller = tw.ThreadWeaverController(TOKENIZER,
                                               max_iterations=max_steps,
                                               response_length=budget)
        expected = tw.run(controller, backend, [PROMPT], {
            "temperature": 0.0,
            "seed": seed,
            "stop_token_ids": list(stop_ids)
        })[0][0]
        engine = ThreadEngine(model, window, budget, {}, seed, stop_ids)
        policy = engine.coordinator.policy
        policy.format = dataclasses.replace(policy.format, max_steps=max_steps)
        assert engine.run(PROMPT) == expected.token_ids
        return expected, engine

    def restarts(engine: ThreadEngine) -> int:
        return sum(isinstance(a, Restart) for a in engine.actions)

    plain, plain_engine = both(())
    expected, engine = both((stop_id, ))
    # The stop changed the controller's calls or its answer.
    assert (expected.calls, expected.token_ids) != (plain.calls,
                                                    plain.token_ids)
    if max_steps == 32 and budget is None:
        # No limit cut it: each more call of the controller's is one the
        # engine makes anew.
        assert restarts(engine) - restarts(plain_engine) == (expected.calls -
                                                             plain.calls)
