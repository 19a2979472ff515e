# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ThreadWeaver's format with ``{"controller": "simple_eval"}`` on the
real V1 scheduler against ThreadWeaver's evaluation controller
(`branching_generate`), model-free: the same answer text, and each
thread as the controller's (label, tokens, finish reason).

One scripted model (`threadweaver_scripts`), on the toy's tokenizer, is
behind both: the controller decodes it in text calls as over stock
vLLM's completions API; the plugin's scheduler runs it in-engine, driven
as the engine core drives it (each call after a join a new request under
the root's id, from its text tokenized anew).
"""

from typing import Optional

import pytest
from vllm_sequence_hooks.scheduler import SequenceHookScheduler

from sequence_hooks_references.formats import backends
from sequence_hooks_references.formats import threadweaver_simple_eval as ev
from sequence_hooks_testkit.formats import threadweaver_scripts as scripts
from sequence_hooks_testkit.formats.threadweaver_toy import (EOS, MODEL,
                                                             PROMPT, TOKENIZER)
from sequence_hooks_testkit.v1_batch_queue import (BatchQueueDriver,
                                                   make_request,
                                                   make_scheduler, run_greedy)

WINDOW = 256
PROMPT_TEXT = TOKENIZER.decode(PROMPT)
OUTLINES = ("<Parallel>\n<Outlines>\n<Outline>1: a</Outline>\n"
            "<Outline>2: b</Outline>\n</Outlines>")
ROUND = "<Outlines>\n<Outline>1: a</Outline>\n<Outline>2: b</Outline>\n"
CASES = {
    "several outlines": (OUTLINES + "\n</Parallel>\n24</s>", {
        "1": " 2 3 6\n</Thread>",
        "2": "\n6 4 24</Thread>"
    }),
    "a repeated label":
    ("<Outlines>\n<Outline>1: a</Outline>\n<Outline>1: b</Outline>\n"
     "<Outline>3: c</Outline>\n</Outlines>\n7</s>", {
         "1": " 1</Thread>",
         "3": " 3</Thread>"
     }),
    "a thread that hits EOS": (OUTLINES + "\n9", {
        "1": " 5</s>",
        "2": " 6</Thread>"
    }),
    "a thread that hits the window": (OUTLINES + "\n9", {
        "1": " 5</Thread>",
        "2": " " + "7" * 400
    }),
    "no outline": ("24</s>", {}),
    "an outline with no label":
    ("<Outlines>\n<Outline>a: b</Outline>\n</Outlines> 8</s>", {}),
    "two rounds": (OUTLINES + "\n5 " + ROUND + "</Outlines>\n6</s>", {
        "1": " 1</Thread>",
        "2": " 2</Thread>"
    }),
    "outlines with no <Outlines> in their call":
    (OUTLINES + "\n5 <Outline>1: a</Outline>\n</Outlines>\n6</s>", {
        "1": " 1</Thread>",
        "2": " 2</Thread>"
    }),
    "a thread that writes outlines (threads never fork)":
    (OUTLINES + "\n4</s>", {
        "1": " " + ROUND + "</Outlines> 3</Thread>",
        "2": " 2</Thread>"
    }),
}


def in_engine(model: scripts.ScriptedModel,
              max_tokens: Optional[int]) -> BatchQueueDriver:
    """The answer served by the plugin's scheduler: its driver, run."""
    scheduler = make_scheduler(SequenceHookScheduler,
                               MODEL,
                               False,
                               special_kwargs={
                                   "format": "threadweaver",
                                   "format_options": {
                                       "controller": "simple_eval"
                                   }
                               },
                               max_model_len=WINDOW)
    return run_greedy(
        scheduler, model.next_token,
        make_request(scheduler, "r0", PROMPT, max_tokens
                     or WINDOW - len(PROMPT), EOS))


@pytest.mark.parametrize("budget", [None, 40], ids=["window", "budget 40"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_plugin_answers_as_the_evaluation_controller(name, budget):
    root, threads = CASES[name]
    model = scripts.ScriptedModel(TOKENIZER, PROMPT_TEXT, root, threads)
    # The controller's calls end a token short of its context length.
    controller = ev.SimpleEvalController(TOKENIZER, WINDOW + 1, budget)
    [expected] = ev.run(controller, backends.ScriptedServer(model),
                        [PROMPT_TEXT])
    driver = in_engine(model, budget)
    assert {request_id for request_id, _, _ in driver.outputs} == {"r0"}
    got = [t for _, new, _ in driver.outputs for t in new]
    # The server does not detokenize the EOS that ends a call.
    assert PROMPT_TEXT + TOKENIZER.decode([t for t in got if t != EOS
                                           ]) == expected.text
    if "</Outlines>" not in expected.text:
        # `</Outlines>` never sampled: a plain request, no tree.
        assert "r0" not in driver.trees
        return
    children = driver.trees["r0"]["children"]
    # A repeated label's thread: called once per place by the
    # controller, once in-engine.
    assert [(c["label"], tuple(c["token_ids"]), c["finish_reason"])
            for c in children] == [
                found for fork in expected.forks for found in dict.fromkeys(
                    (t.label, tuple(t.token_ids), t.finish_reason)
                    for t in fork)
            ]


def test_the_cases_write_what_they_are_named_for():
    """Each case's controller run shows its case."""

    def rollout(name: str, budget=None) -> ev.EvalRollout:
        root, threads = CASES[name]
        model = scripts.ScriptedModel(TOKENIZER, PROMPT_TEXT, root, threads)
        return ev.run(ev.SimpleEvalController(TOKENIZER, WINDOW + 1, budget),
                      backends.ScriptedServer(model), [PROMPT_TEXT])[0]

    assert [len(f) for f in rollout("several outlines").forks] == [2]
    assert [t.label
            for t in rollout("a repeated label").forks[0]] == ["1", "1", "3"]
    assert rollout("a thread that hits EOS").forks[0][0].token_ids[-1] == EOS
    assert [
        t.finish_reason
        for t in rollout("a thread that hits the window").forks[0]
    ] == ["stop", "length"]
    assert rollout("no outline").forks == []
    assert rollout("an outline with no label").ended == "no_label"
    assert len(rollout("two rounds").forks) == 2
    assert len(rollout("outlines with no <Outlines> in their call").forks) == 2
    assert len(
        rollout("a thread that writes outlines "
                "(threads never fork)").forks) == 1
    cut = rollout("a thread that hits the window", 40).forks[0][1]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 40
