# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ThreadWeaver's format with ``{"controller": "simple_eval"}`` served
in-engine by the V1 plugin against ThreadWeaver's evaluation controller
(`branching_generate`, the test kit's `SimpleEvalController`) over stock
vLLM, on models/threadweaver-toy, greedy, each side in a process of its
own: the same answer text for every held-out prompt, and each thread in
the tree as the controller's (label, tokens, finish reason).

Cases: no budget (each call's budget the window left, as the evaluation
script gives it) and a budget of 40 a call (the controller's
``max_new_tokens``, the request's ``max_tokens`` in-engine), which cuts
calls and threads.
"""

import json
from pathlib import Path

import pytest

from sequence_hooks_testkit.formats.sides import (REFERENCES, TESTKIT, run,
                                                  toy_prompts)
from sequence_hooks_training import threadweaver_task as task_mod

MODEL = Path(__file__).resolve().parents[2] / "models" / "threadweaver-toy"
TOKENIZER = task_mod.build_tokenizer()
PROMPTS = toy_prompts(MODEL)
# Each case's budget a call (None: the window left).
CASES = {"no budget": None, "budget 40": 40}


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> tuple[dict, dict]:
    """Each case on both sides: the controller's answers, the engine's."""
    controller = run(REFERENCES + "run_threadweaver_simple_eval", MODEL, [],
                     [{
                         "name": name,
                         "prompts": PROMPTS,
                         "max_new_tokens": budget
                     } for name, budget in CASES.items()],
                     tmp_path_factory.mktemp("eval"))
    engine = run(TESTKIT + "run_in_engine", MODEL, [
        "threadweaver", "--format-options",
        json.dumps({"controller": "simple_eval"})
    ], [{
        "name": name,
        "prompts": PROMPTS,
        "max_tokens": budget
    } for name, budget in CASES.items()], tmp_path_factory.mktemp("engine"))
    return controller, engine


def answer_text(prompt: str, token_ids: list[int], expected: str) -> str:
    """An engine's answer as the controller's text: the prompt and the
    output, less a last EOS the controller's server leaves out (one its
    call stopped at, not one it sampled as its last allowed token)."""
    eos = TOKENIZER.eos_token_id
    text = prompt + TOKENIZER.decode(token_ids)
    if token_ids[-1:] == [eos] and not expected.endswith(TOKENIZER.eos_token):
        text = prompt + TOKENIZER.decode(token_ids[:-1])
    return text


@pytest.mark.parametrize("name", CASES)
def test_the_engine_answers_as_the_evaluation_controller(answers, name):
    controller, engine = answers
    rollouts = controller[name]["rollouts"]
    for prompt, want, have in zip(PROMPTS,
                                  rollouts,
                                  engine[name]["answers"],
                                  strict=True):
        assert answer_text(prompt, have["token_ids"],
                           want["text"]) == want["text"]
        threads = [
            found for fork in want["forks"] for found in dict.fromkeys(
                (t["label"], tuple(t["token_ids"]), t["finish_reason"])
                for t in fork)
        ]
        children = (have["tree"] or {}).get("children") or []
        assert [(c["label"], tuple(c["token_ids"]), c["finish_reason"])
                for c in children] == threads
    # The toy forks, and the budget cuts: the comparison covers joins and
    # the calls' ends, not only plain decoding.
    assert sum(len(want["forks"]) for want in rollouts) > 0
    if CASES[name] is not None:
        assert any(want["ended"] == "length" for want in rollouts)
