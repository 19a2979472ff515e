# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm serve --special-kwargs`: the OpenAI API over a real server.

One server (V0, its engine in its own process: the suite's shared one)
runs the tiny model on a free loopback port. Promise/sync programs are
forced per request through `logits_processors` in the request body, which
the server builds from `scripted_hooks.from_role_plans` (allowed by
`--logits-processor-pattern`). What `vllm serve` refuses at start and
its help run as the `vllm` command runs them, vLLM imported once for them
all (`cli_forks`). Every wait is bounded.
"""

import json
import sys
import time

import httpx
import openai
import pytest

from sequence_hooks_testkit.cli_forks import ForkedCommands
from sequence_hooks_testkit.oracle import scripted
from sequence_hooks_testkit.programs import two_children
from sequence_hooks_testkit.server import (STARTUP_SECONDS, free_port, metric,
                                           scripted_request_body,
                                           serve_command, server_env)
from vllm import SamplingParams

# The shared servers its tests use (conftest's `shared_servers`).
pytestmark = pytest.mark.shares("hooked")

PROMPT = "the cat sees"


@pytest.fixture(scope="module")
def server(shared_servers):
    """The suite's shared hooked server: its URL, model and log."""
    hooked = shared_servers.get("hooked")
    return hooked.base, hooked.model, hooked.log


@pytest.fixture(scope="module")
def vllm_command(tmp_path_factory):
    """Runs `vllm` command lines as the `vllm` command does, each in a
    process of its own, with vLLM imported once for the module
    (`cli_forks`), in a test server's environment."""
    with ForkedCommands(sys.executable, server_env(),
                        tmp_path_factory.mktemp("vllm-command")) as commands:
        yield commands


def client(server) -> openai.OpenAI:
    base, _, _ = server
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60)


# vLLM 0.9.2 exports no KV usage on the CPU (its gpu_cache_usage_perc
# carries the swap space there); the hooks export it.
KV_USAGE = "vllm:sequence_hook_kv_cache_usage_perc"


def server_metric(server, name: str) -> float:
    base, model, _ = server
    return metric(base, name, model)


def greedy(server, **fields) -> dict:
    """A greedy completion of PROMPT, 40 tokens at most, with ``fields``."""
    _, model, _ = server
    return dict(model=model,
                prompt=PROMPT,
                max_tokens=40,
                temperature=0.0,
                **fields)


def offline_greedy(hooked_llm, plans, hook_ids, **params):
    """The same greedy program run offline, with sampling ``params``."""
    [offline] = hooked_llm.generate(
        [PROMPT],
        SamplingParams(temperature=0.0,
                       max_tokens=40,
                       logits_processors=[scripted(plans, hook_ids)],
                       **params),
        use_tqdm=False)
    return offline


def served_and_offline(server, hooked_llm, plans, hook_ids):
    """The same greedy program as a served completion and offline."""
    served = client(server).completions.create(
        **greedy(server, extra_body=scripted_request_body(plans, hook_ids)))
    return served, offline_greedy(hooked_llm, plans, hook_ids)


def test_completion_carries_the_merged_children(server, hooked_llm, hook_ids):
    plans = two_children(hook_ids)
    served, offline = served_and_offline(server, hooked_llm, plans, hook_ids)
    assert served.choices[0].text == offline.outputs[0].text
    for child in offline.promise_tree.children:
        assert child.text.strip() and child.text.strip(
        ) in served.choices[0].text
    # Usage counts every token of the parent's output, merged ones included.
    assert served.usage.completion_tokens == len(offline.outputs[0].token_ids)
    assert served.usage.prompt_tokens == len(offline.prompt_token_ids)


def test_streamed_completion_delivers_the_parents_deltas(server, hook_ids):
    plans = two_children(hook_ids)
    kwargs = greedy(server, extra_body=scripted_request_body(plans, hook_ids))
    whole = client(server).completions.create(**kwargs).choices[0].text
    chunks = list(client(server).completions.create(stream=True, **kwargs))
    texts = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    assert "".join(texts) == whole
    assert len([t for t in texts if t]) > 3
    # One stream: the parent's; no child's output leaks into it.
    assert {chunk.id for chunk in chunks} == {chunks[0].id}
    assert {c.index for chunk in chunks for c in chunk.choices} == {0}


def test_chat_plain_and_streamed(server, hook_ids):
    plans = two_children(hook_ids)
    _, model, _ = server
    kwargs = dict(model=model,
                  messages=[{
                      "role": "user",
                      "content": PROMPT
                  }],
                  max_tokens=40,
                  temperature=0.0,
                  extra_body=scripted_request_body(plans, hook_ids))
    whole = client(server).chat.completions.create(**kwargs)
    content = whole.choices[0].message.content
    assert len(content.split()) >= 2 + 3 + 4
    streamed = "".join(chunk.choices[0].delta.content or ""
                       for chunk in client(server).chat.completions.create(
                           stream=True, **kwargs) if chunk.choices)
    assert streamed == content


def test_hook_metrics_count_what_a_request_did(server, hooked_llm, hook_ids):
    counters = ("promises_spawned_total", "promises_refused_total",
                "syncs_blocked_total", "blocked_time_seconds_count",
                "merged_tokens_total")

    def read(names):
        return {
            name: server_metric(server, f"vllm:sequence_hook_{name}")
            for name in names
        }

    before = read(counters)
    plans = two_children(hook_ids)
    _, offline = served_and_offline(server, hooked_llm, plans, hook_ids)
    after = read(counters)
    # Two promises; the sync parks the parent (its second child has just
    # started), which is observed once, when the merge wakes it.
    assert {
        name: after[name] - before[name]
        for name in counters
    } == {
        "promises_spawned_total": 2,
        "promises_refused_total": 0,
        "syncs_blocked_total": 1,
        "blocked_time_seconds_count": 1,
        "merged_tokens_total": offline.promise_tree.num_merged_tokens,
    }
    # Idle again: nothing alive, parked or holding KV blocks.
    assert read(
        ("children_running", "parents_parked", "kv_cache_usage_perc")) == {
            "children_running": 0,
            "parents_parked": 0,
            "kv_cache_usage_perc": 0,
        }


def test_disconnect_mid_stream_aborts_the_tree(server, hook_ids):
    base, model, _ = server
    # The parent parks at once; its children write long after it.
    plans = {
        (): [hook_ids.promise, hook_ids.promise, hook_ids.sync, None],
        (0, ): [None] * 200,
        (1, ): [None] * 200,
    }
    spawned = server_metric(server,
                            "vllm:sequence_hook_promises_spawned_total")
    body = dict(model=model,
                prompt=PROMPT,
                max_tokens=240,
                temperature=0.0,
                stream=True,
                **scripted_request_body(plans, hook_ids))
    with httpx.stream("POST", f"{base}/v1/completions", json=body,
                      timeout=60) as response:
        assert response.status_code == 200
        deadline = time.monotonic() + 60
        while server_metric(
                server,
                "vllm:sequence_hook_promises_spawned_total") < spawned + 2:
            assert time.monotonic() < deadline, "children never spawned"
            time.sleep(0.2)
        assert server_metric(server,
                             "vllm:sequence_hook_children_running") == 2
        assert server_metric(server, KV_USAGE) > 0
    # Leaving the block closed the connection mid-stream.
    deadline = time.monotonic() + 60
    while (server_metric(server, "vllm:num_requests_running") > 0
           or server_metric(server, "vllm:sequence_hook_children_running") > 0
           or server_metric(server, KV_USAGE) > 0):
        assert time.monotonic() < deadline, "tree not aborted"
        time.sleep(0.5)
    # The aborted parent's parked time was observed: every park is.
    assert server_metric(server, "vllm:sequence_hook_parents_parked") == 0
    assert server_metric(
        server, "vllm:sequence_hook_syncs_blocked_total") == server_metric(
            server, "vllm:sequence_hook_blocked_time_seconds_count")


@pytest.mark.parametrize(("special_kwargs", "message"), [
    ('{"sync_token": "the cat", "promise_token": "<promise>"}',
     "not a single token"),
    ('{"sync_token_id": 4, "promise_token_id": 5, "colour": 1}', "colour"),
    ('{"sync_token_id": 4, "promise_token_id": 4}', "must differ"),
])
def test_bad_special_kwargs_stop_the_server_at_start(vllm_command,
                                                     tiny_model_path,
                                                     special_kwargs, message):
    # The command line without the command's path.
    _, *args = serve_command(tiny_model_path, free_port(), special_kwargs)
    result = vllm_command.run(args, STARTUP_SECONDS, errors_apart=True)
    assert result.returncode != 0
    assert message in result.output + result.errors


def test_flag_is_listed_in_serve_help(vllm_command):
    result = vllm_command.run(["serve", "--help=VllmConfig"],
                              STARTUP_SECONDS,
                              errors_apart=True)
    assert result.returncode == 0
    assert "--special-kwargs" in result.output
    assert "Sequence hooks:" in result.output


def without_ids(tree: dict) -> dict:
    """A tree's JSON with request ids (which differ per engine) left out."""
    return {
        **{
            k: v
            for k, v in tree.items() if k not in ("request_id", "children")
        },
        "children": [without_ids(child) for child in tree["children"]],
    }


def assert_same_tree(served: dict, expected: dict) -> None:
    served, expected = without_ids(served), without_ids(expected)
    assert served.pop("logprobs") == pytest.approx(expected.pop("logprobs"),
                                                   abs=1e-4)
    assert served.pop("cumulative_logprob") == pytest.approx(
        expected.pop("cumulative_logprob"), abs=1e-4)
    children = zip(served.pop("children"), expected.pop("children"))
    assert served == expected
    for served_child, expected_child in children:
        assert_same_tree(served_child, expected_child)


def test_promise_tree_over_the_api(server, hooked_llm, hook_ids):
    plans = two_children(hook_ids)
    base, model, _ = server
    body = greedy(server, logprobs=1, **scripted_request_body(plans, hook_ids))
    offline = offline_greedy(hooked_llm, plans, hook_ids, logprobs=1)
    expected = offline.promise_tree.to_dict()
    assert len(expected["children"]) == 2

    # Without the flag, the response is what stock vLLM sends.
    plain = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert "promise_tree" not in plain.text

    body["return_promise_tree"] = True
    whole = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    assert_same_tree(whole["choices"][0]["promise_tree"], expected)

    # Streamed: once, in the choice's final chunk.
    chunks = []
    with httpx.stream("POST",
                      f"{base}/v1/completions",
                      json={
                          **body, "stream": True
                      },
                      timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: "):]))
    with_tree = [
        choice for chunk in chunks for choice in chunk["choices"]
        if "promise_tree" in choice
    ]
    assert len(with_tree) == 1 and with_tree[0]["finish_reason"] == "stop"
    assert_same_tree(with_tree[0]["promise_tree"], expected)

    # Chat: the same field on the message's choice.
    chat = httpx.post(f"{base}/v1/chat/completions",
                      json={
                          "model": model,
                          "messages": [{
                              "role": "user",
                              "content": PROMPT
                          }],
                          "max_tokens": 40,
                          "temperature": 0.0,
                          "return_promise_tree": True,
                          **scripted_request_body(plans, hook_ids)
                      },
                      timeout=60).json()
    tree = chat["choices"][0]["promise_tree"]
    assert [child["text"] for child in tree["children"]
            ] == [child["text"] for child in expected["children"]]
    assert tree["text"] == chat["choices"][0]["message"]["content"]
