# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ThreadWeaver's format with ``{"controller": "simple_eval"}``
(`SimpleEvalPolicy`) against ThreadWeaver's evaluation controller (the
test kit's `SimpleEvalController`, `branching_generate`), with one
scripted model behind both: the same calls (prompt ids and budgets), the
same answer text and the same threads, model-free.

The model continues scripted texts. The controller decodes it over text
calls, as over stock vLLM's completions API (token-id prompts, text out,
stop strings); the in-engine side decodes it in `EvalEngine`
(`call_engine`), which carries out the coordinator's actions on token
lists, with vLLM's stop checks and each call's budget.

The tokenizer merges ``":\\n"`` into one token, so a join whose thread
begins with a newline tokenizes otherwise than the ids sampled: the
engine must send what the controller sends.
"""

from typing import Optional

import pytest
import test_threadweaver as tw_test
from call_engine import CallEngine
from fake_engine import TagTokenizer

from sequence_hooks.actions import Action, Fork, Restart, StartTree
from sequence_hooks.special_kwargs import SpecialKwargs
from sequence_hooks_references.formats import backends
from sequence_hooks_references.formats import threadweaver_simple_eval as ev
from sequence_hooks_testkit.formats import threadweaver_scripts as scripts

# ThreadWeaver's tags (and `<eos>`) one token each, ":\n" one token,
# every other character one token.
TOKENIZER = TagTokenizer(tw_test.TAGS + (":\n", ))
EOS = TOKENIZER.eos_token_id
PROMPT = tw_test.PROMPT_TEXT


def scripted(root: str,
             threads: Optional[dict[str, str]] = None,
             prompt: str = PROMPT) -> scripts.ScriptedModel:
    """The scripted model on this tokenizer."""
    return scripts.ScriptedModel(TOKENIZER, prompt, root, threads or {})


def rl_case(name: str) -> scripts.ScriptedModel:
    """``test_threadweaver``'s case ``name`` (a case of both controllers)
    on this tokenizer."""
    return scripted(tw_test.CASES[name].root, tw_test.CASES[name].threads)


class EvalEngine(CallEngine):
    """`CallEngine` with the evaluation controller's policy: the
    request's budget is each call's, resolved as V1 resolves it (the
    window left after the prompt if none), and a call made anew
    (`Restart`) is made for a parked root, with that budget.

    Args:
        model: The scripted model.
        window: The model length.
        max_tokens: The request's budget (each call's, for this format).
        limits: More `SpecialKwargs` fields.
    """

    def __init__(self,
                 model: scripts.ScriptedModel,
                 window: int,
                 max_tokens: Optional[int],
                 limits: Optional[dict] = None):
        special_kwargs = SpecialKwargs(
            format="threadweaver",
            format_options={"controller": "simple_eval"},
            **(limits or {}))
        prompt_len = len(TOKENIZER.encode(model.prompt))
        super().__init__(
            model, TOKENIZER, special_kwargs, window,
            window - prompt_len if max_tokens is None else max_tokens)

    def carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Restart):
                assert self.members[action.member_id].parked
                assert action.max_tokens is None
            super().carry_out([action])


def both(model: scripts.ScriptedModel,
         budget: Optional[int] = None,
         window: int = 160,
         limits: Optional[dict] = None):
    """The controller's answer and the engine's, on the same model; the
    controller's context length is the window plus one (its calls end a
    token short of it)."""
    controller = ev.SimpleEvalController(TOKENIZER, window + 1, budget)
    [rollout] = ev.run(controller, backends.ScriptedServer(model),
                       [model.prompt])
    engine = EvalEngine(model, window, budget, limits)
    engine.run(TOKENIZER.encode(model.prompt))
    return rollout, engine


def answer_text(engine: EvalEngine) -> str:
    """The engine's answer as the controller's text: the prompt and the
    output, less the EOS its last call stopped at (which the server does
    not detokenize; sampled as the call's last allowed token, it does)."""
    output = engine.output[:-1] if engine.stopped_at_eos else engine.output
    return engine.model.prompt + TOKENIZER.decode(output)


def threads_of(rollout: ev.EvalRollout) -> list[tuple]:
    """The controller's threads, fork after fork, a repeated label once:
    label, sampled ids, finish reason."""
    return [
        found for fork in rollout.forks for found in dict.fromkeys(
            (t.label, tuple(t.token_ids), t.finish_reason) for t in fork)
    ]


def assert_same(rollout: ev.EvalRollout, engine: EvalEngine) -> None:
    """The same calls, the same answer, the same threads."""
    # A repeated label's thread is called once per place by the
    # controller, once in-engine.
    calls = [(tuple(prompt), budget) for prompt, budget in engine.calls]
    assert len(set(calls)) == len(calls)
    assert sorted(calls) == sorted(
        dict.fromkeys((tuple(call.prompt_ids), call.max_tokens)
                      for call in rollout.calls))
    assert answer_text(engine) == rollout.text
    report = engine.tree()
    if report is None:
        assert not rollout.forks
        return
    assert [(c.label, tuple(c.token_ids), c.finish_reason)
            for c in report.tree.children] == threads_of(rollout)


OUTLINES = tw_test.OUTLINES
ROUND = "<Outlines>\n<Outline>1: a</Outline>\n<Outline>2: b</Outline>\n"
CASES = {
    "several outlines":
    scripted(OUTLINES + "\n</Parallel>\nA: 24<eos>", {
        "1": "\n 2*3=6\n</Thread>",
        "2": " 6*4=24</Thread>"
    }),
    "a repeated label":
    rl_case("a repeated label"),
    "a thread that hits EOS":
    rl_case("a thread that hits EOS"),
    "a thread that hits the window":
    rl_case("a thread that hits the window"),
    "a call after a join that hits the window":
    scripted(OUTLINES + "\n" + "y" * 200, {
        "1": " t1</Thread>",
        "2": " t2</Thread>"
    }),
    "no outline":
    rl_case("no outline"),
    "an outline with no label":
    scripted("<Outlines>\n<Outline>a: no number</Outline>\n</Outlines>"
             " never<eos>"),
    "two rounds":
    scripted(OUTLINES + "\nmid " + ROUND + "</Outlines>\nend<eos>", {
        "1": " t1</Thread>",
        "2": "\n t2</Thread>"
    }),
    "outlines with no <Outlines> in their call":
    scripted(OUTLINES + "\nmid <Outline>1: a</Outline>\n</Outlines>\nend<eos>",
             {
                 "1": " t1</Thread>",
                 "2": " t2</Thread>"
             }),
    "a thread that writes outlines (threads never fork)":
    scripted(OUTLINES + "\nend<eos>", {
        "1": " " + ROUND + "</Outlines> t1</Thread>",
        "2": " t2</Thread>"
    }),
}


@pytest.mark.parametrize("budget", [None, 30], ids=["window", "budget 30"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_engine_answers_as_the_evaluation_controller(name, budget):
    rollout, engine = both(CASES[name], budget)
    assert_same(rollout, engine)


def test_the_cases_write_what_they_are_named_for():
    """Each case's controller run shows its case (no budget), and the
    budget cuts a call, not the answer."""

    def rollout(name: str, budget: Optional[int] = None) -> ev.EvalRollout:
        return both(CASES[name], budget)[0]

    assert [[t.label for t in fork]
            for fork in rollout("several outlines").forks] == [["1", "2"]]
    assert [t.label
            for t in rollout("a repeated label").forks[0]] == ["1", "1", "3"]
    assert rollout("a thread that hits EOS").ended == "thread_not_closed"
    assert rollout("a thread that hits EOS").forks[0][0].token_ids[-1] == EOS
    window = rollout("a thread that hits the window")
    assert [t.finish_reason for t in window.forks[0]] == ["stop", "length"]
    assert window.text.endswith("x</Thread>")
    after = rollout("a call after a join that hits the window")
    assert after.ended == "length" and len(after.forks) == 1
    assert rollout("no outline").ended == "no_label"
    assert not rollout("no outline").forks
    unlabelled = rollout("an outline with no label")
    assert unlabelled.ended == "no_label"
    assert unlabelled.text.endswith("</Outlines>")
    assert len(rollout("two rounds").forks) == 2
    assert len(rollout("outlines with no <Outlines> in their call").forks) == 2
    nested = rollout("a thread that writes outlines (threads never fork)")
    assert len(nested.forks) == 1 and "</Outlines>" in nested.forks[0][0].text
    cut = rollout("a thread that hits the window", 30)
    assert [len(t.token_ids) for t in cut.forks[0]][1] == 30
    assert rollout("two rounds", 30).ended == "no_label"
    assert len(rollout("two rounds", 30).text) > 30 + len(PROMPT)


def test_the_join_is_re_tokenized_as_the_controller_sends_it():
    """Thread 1 sampled ``"\\n"`` after its header's ``":"``; the root's
    next call is sent its text tokenized anew, which merges them, as the
    controller sends it; the output shows the join's own tokens."""
    rollout, engine = both(CASES["several outlines"])
    [restart] = [a for a in engine.actions if isinstance(a, Restart)]
    joined = ("\n<Thread>\n1:\n 2*3=6\n</Thread><Thread>\n2: 6*4=24</Thread>"
              "\n")
    assert TOKENIZER.decode(list(restart.shown_token_ids)) == joined
    resent = list(restart.prompt_token_ids)
    assert resent == TOKENIZER.encode(PROMPT + OUTLINES + joined)
    one, two = engine.tree().tree.children
    appended = (TOKENIZER.encode(PROMPT + OUTLINES + "\n<Thread>\n1:") +
                list(one.token_ids) + TOKENIZER.encode("<Thread>\n2:") +
                list(two.token_ids) + TOKENIZER.encode("\n"))
    assert TOKENIZER.decode(appended) == TOKENIZER.decode(resent)
    assert len(resent) == len(appended) - 1
    assert resent in [call.prompt_ids for call in rollout.calls]


def test_no_step_limit():
    """17 rounds, past the RL controller's 32 steps."""
    rounds = "".join(f"<Outlines><Outline>1:</Outline></Outlines>\nr{i} "
                     for i in range(17))
    model = scripted(rounds + "end<eos>", {"1": " t</Thread>"})
    rollout, engine = both(model, window=1000)
    assert_same(rollout, engine)
    assert len(rollout.forks) == 17 and rollout.text.endswith("end")


@pytest.mark.parametrize("at", ["thread", "next call"])
def test_a_call_with_no_room_ends_the_answer_where_it_would_start(at):
    """A thread's call (its header leaves no token) or the call after a
    join (its prompt fills the window) is not made, as the controller's
    raises: the answer ends with the text before it."""
    model = CASES["several outlines"]
    parked = len(TOKENIZER.encode(PROMPT + OUTLINES))
    header = len(TOKENIZER.encode("\n<Thread>\n1:"))
    window = parked + header if at == "thread" else parked + 20
    rollout, engine = both(model, window=window)
    assert_same(rollout, engine)
    assert rollout.ended == "no_room"
    if at == "thread":
        assert rollout.text == PROMPT + OUTLINES and not rollout.forks
    else:
        assert rollout.text.endswith("</Thread>\n") and rollout.forks


def test_a_stop_sampled_as_a_calls_last_allowed_token_as_its_server():
    """The controller's server checks a call's budget before its stops.
    `</Outlines>` as a call's last allowed token ends the answer there
    (the call ended by its budget); a thread's EOS as its last allowed
    token stays in its text (a thread's `</Thread>` there closes it)."""
    outlines = len(TOKENIZER.encode(OUTLINES))
    rollout, engine = both(CASES["several outlines"], budget=outlines)
    assert_same(rollout, engine)
    assert rollout.ended == "length" and not rollout.forks
    assert rollout.text == PROMPT + OUTLINES
    # Threads 1 and 2 end at their windows' last token: EOS, `</Thread>`.
    parked = len(TOKENIZER.encode(PROMPT + OUTLINES))
    header = len(TOKENIZER.encode("\n<Thread>\n1:"))
    thread = len(TOKENIZER.encode(" done<eos>"))
    assert thread == len(TOKENIZER.encode(" fine</Thread>"))
    rollout, engine = both(CASES["a thread that hits EOS"],
                           window=parked + header + thread)
    assert_same(rollout, engine)
    assert rollout.text.endswith("\n<Thread>\n1: done<eos></Thread>"
                                 "<Thread>\n2: fine</Thread>")


def test_the_limits_leave_refused_labels_out_of_the_join():
    """`max_children_per_sequence` 1: one thread forks; its label's
    places alone are joined (the controller has no limit)."""
    engine = EvalEngine(CASES["a repeated label"], 160, None,
                        {"max_children_per_sequence": 1})
    output = engine.run(TOKENIZER.encode(PROMPT))
    assert [a.label for a in engine.actions if isinstance(a, Fork)] == ["1"]
    assert TOKENIZER.decode(output).endswith(
        "</Outlines>\n<Thread>\n1: one</Thread><Thread>\n1: one</Thread>\n"
        "ok<eos>")
    [start] = [a for a in engine.actions if isinstance(a, StartTree)]
    assert start.tree.num_refused == 1


def test_an_eos_after_numbered_outlines_ends_the_answer_in_engine():
    """A difference (docs/formats.md): a call that ends at EOS with a
    numbered `<Outline>` in its text, no `</Outlines>`. The controller
    forks its threads all the same; the engine ends the answer at the
    EOS."""
    model = scripted("<Outlines>\n<Outline>1: a</Outline>\n<eos>",
                     {"1": " t1</Thread>"})
    rollout, engine = both(model)
    assert [t.label for fork in rollout.forks for t in fork] == ["1"]
    assert engine.tree() is None and engine.output[-1] == EOS
    assert rollout.text.startswith(answer_text(engine))


def test_a_thread_is_sent_its_parents_ids_and_its_header():
    """A difference (docs/formats.md): a thread's prompt is its
    parent's ids and its header's, where the controller tokenizes the
    text anew. They differ where the parent's ids are not its text's
    tokens: here the prompt ends in ``":"`` and the root's first sampled
    token is ``"\\n"``."""
    model = scripted("\n" + OUTLINES + "\n</Parallel>\nA: 24<eos>", {
        "1": " t1</Thread>",
        "2": " t2</Thread>"
    }, "Q: 2*3*4?\nA:")
    rollout, engine = both(model)
    assert answer_text(engine) == rollout.text
    prompt = TOKENIZER.encode(model.prompt)
    forks = [a for a in engine.actions if isinstance(a, Fork)]
    engine_threads = [c for c, _ in engine.calls[1:3]]
    assert all(c[:len(prompt) + 1] == prompt + TOKENIZER.encode("\n")
               for c in engine_threads) and len(forks) == 2
    controller_threads = [c.prompt_ids for c in rollout.calls[1:3]]
    assert all(c[len(prompt) - 1] == TOKENIZER.encode(":\n")[0]
               for c in controller_threads)
    assert [len(c) for c in controller_threads
            ] == [len(c) - 1 for c in engine_threads]
