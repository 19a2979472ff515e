# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ThreadWeaver's format served in-engine by the V1 plugin
(``special_kwargs={"format": "threadweaver"}``) against ThreadWeaver's own
controller over stock vLLM, on models/threadweaver-toy, greedy, each side
in a process of its own: the same answers token for token, and the tree
holds each thread's label and tokens as the controller's branches.

Cases: the toy's held-out prompts with no budget (each call's budget the
window left, as the reference's server gives it) and with a response
budget (the controller's ``response_length``, the request's
``max_tokens`` in-engine); offline (`LLM(..., special_kwargs=)`) and over
the OpenAI API (`vllm serve --special-kwargs`), completions and chat,
whole and streamed.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sequence_hooks_testkit.formats.toy_server import choices, toy_server
from sequence_hooks_testkit.training import threadweaver_task as task_mod

MODEL = Path(__file__).resolve().parents[2] / "models" / "threadweaver-toy"
TOKENIZER = task_mod.build_tokenizer()
PROMPTS = [
    json.loads(line)["prompt"]
    for line in (MODEL / "prompts.jsonl").read_text().splitlines()
][:8]
BUDGETS = {"no budget": None, "budget 60": 60}
# The toy has no chat template: the server's renders the user's message
# as it is, so a chat prompt is the completions prompt's text.
CHAT_TEMPLATE = "{{ messages[0]['content'] }}"


def run(module: str, args: list, cases: list, folder: Path) -> dict:
    (folder / "cases.json").write_text(json.dumps(cases))
    subprocess.run([
        sys.executable, "-m", f"sequence_hooks_testkit.formats.{module}",
        str(MODEL), *args, folder / "cases.json", folder / "out.json"
    ],
                   check=True,
                   timeout=1200)
    return {
        case["name"]: case
        for case in json.loads((folder / "out.json").read_text())
    }


# Sampled, two samples a prompt: the controller seeds every call of
# sample i with seed + i, as V1 seeds sample i of an `n > 1` request.
SEEDED = {"temperature": 1.0, "seed": 1234}


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> tuple[dict, dict]:
    """Each case on both sides: the controller's rollouts, the engine's
    answers."""
    controller = run("run_threadweaver", [], [{
        "name": name,
        "prompts": PROMPTS,
        "settings": {} if budget is None else {
            "response_length": budget
        }
    } for name, budget in BUDGETS.items()] + [{
        "name": "n=2 seeded",
        "prompts": PROMPTS,
        "sampling": SEEDED,
        "n": 2
    }], tmp_path_factory.mktemp("controller"))
    engine = run("run_in_engine", ["threadweaver"], [{
        "name": name,
        "prompts": PROMPTS,
        "max_tokens": budget
    } for name, budget in BUDGETS.items()] + [{
        "name": "n=2 seeded",
        "prompts": PROMPTS,
        "max_tokens": None,
        "sampling": dict(SEEDED, n=2)
    }], tmp_path_factory.mktemp("engine"))
    return controller, engine


@pytest.mark.parametrize("name", [*BUDGETS, "n=2 seeded"])
def test_the_engine_answers_as_the_controller_token_for_token(answers, name):
    """Greedy, and seeded with two samples a prompt: a seeded join is a
    new call (`Restart`), seeded anew as the controller's next call."""
    controller, engine = answers
    expected = [one for per in controller[name]["rollouts"] for one in per]
    got = engine[name]["answers"]
    for want, have in zip(expected, got, strict=True):
        assert have["token_ids"] == want["token_ids"]
        assert TOKENIZER.decode(have["token_ids"]) == want["text"]
    # The toy forks: the comparison covers joins, not only plain decoding.
    assert sum(len(want["forks"]) for want in expected) > 0


def test_the_tree_holds_each_thread_as_the_controllers_branch(answers):
    controller, engine = answers
    expected = [per[0] for per in controller["no budget"]["rollouts"]]
    for want, have in zip(expected, engine["no budget"]["answers"]):
        branches = [b for fork in want["forks"] for b in fork["branches"]]
        if not branches:
            assert have["tree"] is None or not have["tree"]["children"]
            continue
        children = have["tree"]["children"]
        assert [c["label"] for c in children] == [b["label"] for b in branches]
        assert [c["token_ids"]
                for c in children] == [b["token_ids"] for b in branches]
        assert [c["finish_reason"]
                for c in children] == [b["finish_reason"] for b in branches]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`vllm serve` of the toy with the format, as a user starts it."""
    with toy_server(
            MODEL,
            tmp_path_factory.mktemp("served") / "server.log",
        ("--special-kwargs", json.dumps({"format": "threadweaver"}),
         "--chat-template", CHAT_TEMPLATE)) as url:
        yield url


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_over_the_api_the_engine_answers_as_the_controller(
        answers, served, chat, stream):
    controller, _ = answers
    expected = [per[0] for per in controller["no budget"]["rollouts"]]
    for prompt, want in zip(PROMPTS, expected):
        prompt_ids = TOKENIZER.encode(prompt, add_special_tokens=False)
        body = {
            "model": str(MODEL),
            "max_tokens": 512 - len(prompt_ids),
            "temperature": 0.0,
            "return_token_ids": True,
            "stream": stream,
        }
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt_ids
        path = "/v1/chat/completions" if chat else "/v1/completions"
        got, answer = choices(served, path, body, timeout=300)
        token_ids = [
            t for choice in got for t in choice.get("token_ids") or ()
        ]
        if not stream:
            tree = (answer.get("kv_transfer_params") or {}).get("promise_tree")
            branches = [b for fork in want["forks"] for b in fork["branches"]]
            if branches:
                assert [c["label"] for c in tree["children"]
                        ] == [b["label"] for b in branches]
        assert token_ids == want["token_ids"]
