# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ThreadWeaver's cases on the real V1 scheduler against ThreadWeaver's
controller, model-free: the answer token for token, and the tree (each
thread's label, tokens, finish reason and fork position; where the root
took each join).

The toy model's served runs (test_formats_threadweaver_in_engine.py)
cover only the cases the toy happens to write; it never ends a thread at
EOS, for one. Here one scripted model (`threadweaver_scripts`), on the
toy's tokenizer, is behind both sides: the controller decodes it call by
call as over stock vLLM (each call to its stop id, EOS or budget); the
plugin's scheduler runs it in-engine, driven as the engine core drives
it. Each case writes what it is named for. The one difference the
engine has (a join past the window) is asserted where it occurs.
"""

from typing import Optional

import pytest
from vllm_sequence_hooks.scheduler import SequenceHookScheduler

from sequence_hooks_references.formats import threadweaver_controller as tw
from sequence_hooks_references.formats.backends import ScriptedBackend
from sequence_hooks_testkit.formats import threadweaver_scripts as scripts
from sequence_hooks_testkit.formats.threadweaver_toy import (EOS, MODEL,
                                                             PROMPT, TOKENIZER)
from sequence_hooks_testkit.v1_batch_queue import (BatchQueueDriver,
                                                   make_request,
                                                   make_scheduler, run_greedy)

WINDOW = 256
PROMPT_TEXT = TOKENIZER.decode(PROMPT)


def scripted(
        root: str,
        threads: Optional[dict[str, str]] = None) -> scripts.ScriptedModel:
    """The scripted model on the toy's tokenizer (a script ends with EOS
    where it writes ``</s>``)."""
    return scripts.ScriptedModel(TOKENIZER, PROMPT_TEXT, root, threads or {})


OUTLINES = ("<Parallel>\n<Outlines>\n<Outline>1: a</Outline>\n"
            "<Outline>2: b</Outline>\n</Outlines>")
CASES = {
    "several outlines":
    scripted(OUTLINES + "\n</Parallel>\n24</s>", {
        "1": " 2 3 6\n</Thread>",
        "2": " 6 4 24\n</Thread>"
    }),
    "a repeated label":
    scripted(
        "<Outlines>\n<Outline>1: a</Outline>\n<Outline>1: b</Outline>\n"
        "<Outline>3: c</Outline>\n</Outlines>\n7</s>", {
            "1": " 1</Thread>",
            "3": " 3</Thread>"
        }),
    "a thread that hits EOS":
    scripted(OUTLINES + "\n9", {
        "1": " 5</s>",
        "2": " 6</Thread>"
    }),
    "a thread that hits the window":
    scripted(OUTLINES + "\n9", {
        "1": " 5</Thread>",
        "2": " " + "7" * 400
    }),
    "no outline":
    scripted("24</s>"),
    "an outline with no label":
    scripted("<Outlines>\n<Outline>a: b</Outline>\n</Outlines> 8</s>"),
    "two rounds":
    scripted(
        OUTLINES + "\n5 " + OUTLINES.replace("<Parallel>\n", "") + "\n6</s>", {
            "1": " 1</Thread>",
            "2": " 2</Thread>"
        }),
    "a thread that writes outlines (threads never fork)":
    scripted(
        OUTLINES + "\n4</s>", {
            "1":
            " <Outlines>\n<Outline>3: c</Outline>\n</Outlines> 3</Thread>",
            "2": " 2</Thread>"
        }),
}

# ThreadWeaver's `no_conclusion=False`: each join's suffix opens an empty
# <Conclusion>, which the root goes on from (or ends with).
CONCLUSION_CASES = {
    "several outlines":
    scripted(OUTLINES + "\n<Conclusion>\n24\n</Conclusion>\n</Parallel></s>",
             CASES["several outlines"].threads),
    "a thread that hits EOS":
    CASES["a thread that hits EOS"],
}


def in_engine(
    model: scripts.ScriptedModel,
    max_tokens: int,
    special_kwargs: Optional[dict] = None,
    stop_token_ids: tuple[int, ...] = ()
) -> BatchQueueDriver:
    """The answer served by the plugin's scheduler: its driver, run."""
    scheduler = make_scheduler(SequenceHookScheduler,
                               MODEL,
                               False,
                               special_kwargs={
                                   "format": "threadweaver",
                                   **(special_kwargs or {})
                               },
                               max_model_len=WINDOW)
    return run_greedy(
        scheduler, model.next_token,
        make_request(scheduler,
                     "r0",
                     PROMPT,
                     max_tokens,
                     EOS,
                     stop_token_ids=stop_token_ids))


@pytest.mark.parametrize("budget", [None, 60], ids=["window", "budget 60"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_plugin_answers_as_threadweavers_controller(name, budget):
    assert_as_controller(
        CASES[name], budget, name == "a thread that hits the window"
        and budget is None)


@pytest.mark.parametrize("name", list(CONCLUSION_CASES))
def test_no_conclusion_false_answers_as_the_controllers_variant(name):
    """``{"format_options": {"no_conclusion": false}}`` serves the
    controller's variant."""
    expected = assert_as_controller(CONCLUSION_CASES[name],
                                    None,
                                    False,
                                    no_conclusion=False)
    assert "<Conclusion>" in expected.text


def assert_as_controller(model: scripts.ScriptedModel,
                         budget,
                         past_window: bool,
                         no_conclusion: bool = True) -> tw.Rollout:
    """The plugin serves ``model`` as the controller does, with the
    response budget ``budget`` (None: the window); ``past_window``: the
    controller's answer runs past the window. Returns its rollout."""
    controller = tw.ThreadWeaverController(TOKENIZER,
                                           no_conclusion=no_conclusion,
                                           response_length=budget)
    [[expected]] = tw.run(controller,
                          ScriptedBackend(model.next_token, EOS, WINDOW),
                          [PROMPT])
    driver = in_engine(
        model, budget or WINDOW - len(PROMPT), None
        if no_conclusion else {"format_options": {
            "no_conclusion": False
        }})
    got = [t for request_id, new, _ in driver.outputs for t in new]
    assert {request_id for request_id, _, _ in driver.outputs} == {"r0"}
    # The one difference (docs/formats.md): a join past the window is cut
    # there in-engine, where the controller appends it all and stops.
    window = WINDOW - len(PROMPT)
    assert got == expected.token_ids[:window]
    assert (len(expected.token_ids) > window) == past_window
    if controller.outlines_end_id not in expected.token_ids:
        # The trigger never sampled: a plain request, no tree.
        assert "r0" not in driver.trees
        return expected
    tree = driver.trees["r0"]
    branches = [b for fork in expected.forks for b in fork.branches]
    assert [(c["label"], c["token_ids"], c["finish_reason"])
            for c in tree["children"]
            ] == [(b.label, b.token_ids, b.finish_reason) for b in branches]
    assert [c["fork_position"] for c in tree["children"]] == [
        fork.position for fork in expected.forks for _ in fork.branches
    ]
    # Each join: where the root took it, and its tokens (headers, threads
    # cut at EOS, closures, suffix), none of them sampled; the last cut
    # where the answer is (the budget, or the window).
    end = min(len(expected.token_ids), window)
    spans = [(fork.position,
              min(
                  sum(len(b.joined_ids)
                      for b in fork.branches) + len(fork.suffix_ids),
                  end - fork.position)) for fork in expected.forks]
    assert [tuple(s) for s in tree["merged_spans"]] == spans
    return expected


@pytest.mark.parametrize("stops", [":", "6", "4", ":64"])
@pytest.mark.parametrize("budget", [None, 60], ids=["window", "budget 60"])
def test_a_requests_own_stop_ids_make_the_controllers_next_call(stops, budget):
    """The controller merges the request's stop ids into each call's: a
    sequential call that ends at one is followed by another from the
    whole context, a thread that ends at one is closed by the join. The
    plugin's answer is the controller's, the stops among its tokens (":"
    in the outlines, "6" in the threads, "4" in a thread and after the
    join), and the tree's threads are its branches."""
    model = CASES["several outlines"]
    stop_ids = tuple(TOKENIZER.encode(stops, add_special_tokens=False))
    controller = tw.ThreadWeaverController(TOKENIZER, response_length=budget)
    backend = ScriptedBackend(model.next_token, EOS, WINDOW)
    [[plain]] = tw.run(controller, backend, [PROMPT])
    [[expected]] = tw.run(controller, backend, [PROMPT], {
        "temperature": 0.0,
        "stop_token_ids": list(stop_ids)
    })
    assert (expected.calls, expected.token_ids) != (plain.calls,
                                                    plain.token_ids)
    driver = in_engine(model,
                       budget or WINDOW - len(PROMPT),
                       stop_token_ids=stop_ids)
    got = [t for request_id, new, _ in driver.outputs for t in new]
    assert {request_id for request_id, _, _ in driver.outputs} == {"r0"}
    assert got == expected.token_ids
    assert any(t in stop_ids for t in got)
    # The root is a tree from its arrival: its calls' ends are reported.
    tree = driver.trees["r0"]
    branches = [b for fork in expected.forks for b in fork.branches]
    assert [(c["label"], c["token_ids"], c["finish_reason"])
            for c in tree["children"]
            ] == [(b.label, b.token_ids, b.finish_reason) for b in branches]


def test_the_cases_write_what_they_are_named_for():
    """Each case's controller run shows its case."""

    def rollout(name: str, budget=None) -> tw.Rollout:
        controller = tw.ThreadWeaverController(TOKENIZER,
                                               response_length=budget)
        return tw.run(controller,
                      ScriptedBackend(CASES[name].next_token, EOS, WINDOW),
                      [PROMPT])[0][0]

    def reasons(name: str) -> list[str]:
        return [
            b.finish_reason for f in rollout(name).forks for b in f.branches
        ]

    assert [len(f.branches) for f in rollout("several outlines").forks] == [2]
    assert [
        b.label for f in rollout("a repeated label").forks for b in f.branches
    ] == ["1", "3"]
    eos_branch = rollout("a thread that hits EOS").forks[0].branches[0]
    assert eos_branch.token_ids[-1] == EOS
    assert reasons("a thread that hits the window") == ["stop", "length"]
    assert rollout("no outline").forks == []
    assert rollout("an outline with no label").forks == []
    assert len(rollout("two rounds").forks) == 2
    nested = rollout("a thread that writes outlines (threads never fork)")
    assert len(nested.forks) == 1
    assert "</Outlines>" in TOKENIZER.decode(
        nested.forks[0].branches[0].token_ids)
    # A budget cuts the answer, not a thread (whose call has the window).
    cut = rollout("a thread that hits the window", 60)
    assert cut.forks[0].branches[1].finish_reason == "length"
    assert len(cut.forks[0].branches[1].token_ids) > 60
    assert len(cut.token_ids) == 60
