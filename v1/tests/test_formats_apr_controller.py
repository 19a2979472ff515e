# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""APR's controller (the test kit's client join of its format), step by
step on scripted completions: the children it reads from the trace, their
fresh prompts, the text join into the cut-back parent, the answer."""

from sequence_hooks_references.formats.apr_controller import (APRController,
                                                              TextCompletion,
                                                              run_apr)
from sequence_hooks_references.formats.apr_trace import (child_budget,
                                                         search_result)

BOS = "<s>"
ROOT = "Moving to Node #0\nCurrent State: 39:[25, 36, 51, 49], Operations: []\n"
CALLING = ("Exploring Operation: 51-49=2, Resulting Numbers: [25, 36, 2]\n"
           "Generated Node #0,0: 39:[25, 36, 2] Operation: 51-49=2\n"
           "Exploring Operation: 36-25=11, Resulting Numbers: [51, 49, 11]\n"
           "Generated Node #0,1: 39:[51, 49, 11] Operation: 36-25=11\n"
           "<Calling Sub Searches>\n"
           "<Start Sub Search 0 at level 1> Moving to Node #0,0\n"
           "<Start Sub Search 1 at level 1> Moving to Node #0,1\n"
           "<End Calling Sub Searches>\n")
FAILS = "Exploring Operation: 25+36=61\n61,39 unequal: No Solution\n"
WINS = ("Exploring Operation: 51-11=40\n39,39 equal: Goal Reached\n"
        "51-11=40\n49-40=9 Goal Reached\n")
FINAL = ("Moving to Node #0,1\n39,39 equal: Goal Reached\n"
         "36-25=11 Goal Reached\n")


class ScriptedText:
    """Answers by the prompt's shape; records the calls."""

    def __init__(self, parent: str = CALLING):
        self.parent = parent
        self.calls = []

    def generate_text(self, prompts, params):
        self.calls.append(list(zip(prompts, params)))
        return [self.reply(p) for p in prompts]

    def reply(self, prompt: str) -> TextCompletion:
        if "<End Sub Searches>" in prompt:
            return TextCompletion(FINAL, "stop", None)
        if "#0,0\n" in prompt:
            return TextCompletion(FAILS, "stop", None)
        if "#0,1\n" in prompt:
            return TextCompletion(WINS, "stop", None)
        return TextCompletion(self.parent, "stop", None)


def test_children_start_fresh_and_join_as_text_into_the_cut_back_parent():
    backend = ScriptedText()
    [out] = run_apr(APRController(BOS, max_tokens=100), backend, [ROOT])
    [[(first, params)], children, [(joined, _)]] = backend.calls
    assert first == BOS + ROOT
    assert params == {
        "temperature": 0.0,
        "stop": ["<Sub Searches>"],
        "max_tokens": 100
    }
    assert [p for p, _ in children] == [
        BOS + "Moving to Node #0,0\nCurrent State: 39:[25, 36, 2], "
        "Operations: ['51-49=2']",
        BOS + "Moving to Node #0,1\nCurrent State: 39:[51, 49, 11], "
        "Operations: ['36-25=11']"
    ]
    cut = ROOT + CALLING.split("<Calling Sub Searches>\n")[0]
    assert joined == BOS + cut + (
        "<Sub Searches>\n"
        "<No Solution in Sub Search 0 at level 1 at Node #0,0>\n"
        "<Goal Reached in Sub Search 1 at level 1 at Node #0,1>\n"
        "51-11=40\n49-40=9 Goal Reached\n<End Sub Searches>\n")
    assert out.rounds == [[
        "Moving to Node #0,0\nCurrent State: 39:[25, 36, 2], "
        "Operations: ['51-49=2']" + FAILS.rstrip("\n"),
        "Moving to Node #0,1\nCurrent State: 39:[51, 49, 11], "
        "Operations: ['36-25=11']" + WINS.rstrip("\n")
    ]]
    assert out.answer == "36-25=11 Goal Reached" and len(out.calls) == 4
    assert out.trace == joined[len(BOS):] + FINAL.rstrip("\n")


def test_the_model_s_own_sub_searches_tag_becomes_a_call():
    backend = ScriptedText()
    backend.reply = lambda prompt: (
        TextCompletion("x\n", "stop", "<Sub Searches>")
        if len(backend.calls) == 1 else TextCompletion("y\n", "stop", None))
    [out] = run_apr(APRController(BOS, max_tokens=100), backend, [ROOT])
    assert backend.calls[1][0][0] == BOS + ROOT + "x\n<Calling Sub Searches>"
    assert out.trace == ROOT + "x\n<Calling Sub Searches>y"
    assert out.answer is None and out.rounds == []


def test_a_call_of_a_node_the_trace_never_made_gives_up():
    backend = ScriptedText(
        CALLING.replace("Node #0,1\n<End", "Node #0,7\n"
                        "<End"))
    [out] = run_apr(APRController(BOS, max_tokens=100), backend, [ROOT])
    assert out.error.startswith("KeyError") and out.answer is None
    assert len(backend.calls) == 1


def test_results_and_budgets():
    assert search_result("a Goal Reached\nb") is None
    assert search_result("x Goal Reached\n Goal Reached\npath\nGoal Reached"
                         ) == "path\nGoal Reached"
    assert child_budget(4096, 3, True) == 1536
    assert child_budget(4096, 3, False) == 4096
    assert child_budget(None, 3, True) is None
