# SPDX-License-Identifier: Apache-2.0
"""`vllm serve --special-kwargs`: the OpenAI API over a real server.

One server (V0, its engine in its own process) runs the tiny model on a
free loopback port for the module. Promise/sync programs are forced per
request through `logits_processors` in the request body, which the server
builds from `scripted_hooks.from_role_plans` (allowed by
`--logits-processor-pattern`). Every wait is bounded.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from oracle import scripted
from tiny_model import SPECIAL_TOKENS

from vllm import SamplingParams

MYTESTS = Path(__file__).resolve().parent
VLLM = str(Path(sys.executable).parent / "vllm")
HOOKS_JSON = json.dumps({
    "sync_token": "<sync>",
    "promise_token": "<promise>",
    "child_role_token": "<child>"
})
STARTUP_SECONDS = 180
PROMPT = "the cat sees"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model, port, special_kwargs=HOOKS_JSON):
    return [
        VLLM, "serve",
        str(model), "--host", "127.0.0.1", "--port",
        str(port), "--max-model-len", "256", "--enforce-eager", "--dtype",
        "float32", "--special-kwargs", special_kwargs,
        "--logits-processor-pattern", r"scripted_hooks\."
    ]


def server_env() -> dict:
    # No VLLM_USE_V1: the fork must choose V0 for a hooked model itself.
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V1"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(MYTESTS)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    return env


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    with log.open("w") as out:
        process = subprocess.Popen(serve_command(tiny_model_path, port),
                                   stdout=out,
                                   stderr=subprocess.STDOUT,
                                   env=server_env())
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_SECONDS
    try:
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        yield base, str(tiny_model_path), log
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def program(ids, child_tokens=(3, 4)):
    """A parent that promises two children, syncs, writes two more words."""
    P, S = ids.promise, ids.sync
    plans = {(): [None, P, None, P, S, None, None]}
    for k, n in enumerate(child_tokens):
        plans[(k, )] = [None] * n
    return plans


def request_body(plans, ids) -> dict:
    return {
        "logits_processors": [{
            "qualname": "scripted_hooks.from_role_plans",
            "kwargs": {
                "role_plans":
                [[list(role), plan] for role, plan in plans.items()],
                "promise_id": ids.promise,
                "child_id": ids.child,
                "eos_id": ids.eos,
                "masked_ids": list(range(len(SPECIAL_TOKENS))),
            },
        }]
    }


def client(server) -> openai.OpenAI:
    base, _, _ = server
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60)


# vLLM 0.9.2 exports no KV usage on the CPU (its gpu_cache_usage_perc
# carries the swap space there); the hooks export it.
KV_USAGE = "vllm:sequence_hook_kv_cache_usage_perc"


def metric(server, name: str) -> float:
    base, model, _ = server
    text = httpx.get(f"{base}/metrics", timeout=10).text
    prefix = f'{name}{{model_name="{model}"}} '
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    raise AssertionError(f"{name} not on /metrics")


def test_completion_carries_the_merged_children(server, hooked_llm, hook_ids):
    plans = program(hook_ids)
    _, model, _ = server
    served = client(server).completions.create(model=model,
                                               prompt=PROMPT,
                                               max_tokens=40,
                                               temperature=0.0,
                                               extra_body=request_body(
                                                   plans, hook_ids))
    [offline] = hooked_llm.generate(
        [PROMPT],
        SamplingParams(temperature=0.0,
                       max_tokens=40,
                       logits_processors=[scripted(plans, hook_ids)]),
        use_tqdm=False)
    assert served.choices[0].text == offline.outputs[0].text
    for child in offline.promise_tree.children:
        assert child.text.strip() and child.text.strip(
        ) in served.choices[0].text
    # Usage counts every token of the parent's output, merged ones included.
    assert served.usage.completion_tokens == len(offline.outputs[0].token_ids)
    assert served.usage.prompt_tokens == len(offline.prompt_token_ids)


def test_streamed_completion_delivers_the_parents_deltas(server, hook_ids):
    plans = program(hook_ids)
    _, model, _ = server
    kwargs = dict(model=model,
                  prompt=PROMPT,
                  max_tokens=40,
                  temperature=0.0,
                  extra_body=request_body(plans, hook_ids))
    whole = client(server).completions.create(**kwargs).choices[0].text
    chunks = list(client(server).completions.create(stream=True, **kwargs))
    texts = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    assert "".join(texts) == whole
    assert len([t for t in texts if t]) > 3
    # One stream: the parent's; no child's output leaks into it.
    assert {chunk.id for chunk in chunks} == {chunks[0].id}
    assert {c.index for chunk in chunks for c in chunk.choices} == {0}


def test_chat_plain_and_streamed(server, hook_ids):
    plans = program(hook_ids)
    _, model, _ = server
    kwargs = dict(model=model,
                  messages=[{
                      "role": "user",
                      "content": PROMPT
                  }],
                  max_tokens=40,
                  temperature=0.0,
                  extra_body=request_body(plans, hook_ids))
    whole = client(server).chat.completions.create(**kwargs)
    content = whole.choices[0].message.content
    assert len(content.split()) >= 2 + 3 + 4
    streamed = "".join(chunk.choices[0].delta.content or ""
                       for chunk in client(server).chat.completions.create(
                           stream=True, **kwargs) if chunk.choices)
    assert streamed == content


def test_hook_metrics_are_exported(server):
    for name in ("promises_spawned_total", "promises_refused_total",
                 "syncs_blocked_total", "blocked_time_seconds_count",
                 "children_running", "merged_tokens_total",
                 "kv_cache_usage_perc"):
        assert metric(server, f"vllm:sequence_hook_{name}") >= 0


def test_disconnect_mid_stream_aborts_the_tree(server, hook_ids):
    base, model, _ = server
    # The parent parks at once; its children write long after it.
    plans = {
        (): [hook_ids.promise, hook_ids.promise, hook_ids.sync, None],
        (0, ): [None] * 200,
        (1, ): [None] * 200,
    }
    spawned = metric(server, "vllm:sequence_hook_promises_spawned_total")
    body = dict(model=model,
                prompt=PROMPT,
                max_tokens=240,
                temperature=0.0,
                stream=True,
                **request_body(plans, hook_ids))
    with httpx.stream("POST", f"{base}/v1/completions", json=body,
                      timeout=60) as response:
        assert response.status_code == 200
        deadline = time.monotonic() + 60
        while metric(
                server,
                "vllm:sequence_hook_promises_spawned_total") < spawned + 2:
            assert time.monotonic() < deadline, "children never spawned"
            time.sleep(0.2)
        assert metric(server, "vllm:sequence_hook_children_running") == 2
        assert metric(server, KV_USAGE) > 0
    # Leaving the block closed the connection mid-stream.
    deadline = time.monotonic() + 60
    while (metric(server, "vllm:num_requests_running") > 0
           or metric(server, "vllm:sequence_hook_children_running") > 0
           or metric(server, KV_USAGE) > 0):
        assert time.monotonic() < deadline, "tree not aborted"
        time.sleep(0.5)


@pytest.mark.parametrize(("special_kwargs", "message"), [
    ('{"sync_token": "the cat", "promise_token": "<promise>"}',
     "not a single token"),
    ('{"sync_token_id": 4, "promise_token_id": 5, "colour": 1}', "colour"),
    ('{"sync_token_id": 4, "promise_token_id": 4}', "must differ"),
])
def test_bad_special_kwargs_stop_the_server_at_start(tiny_model_path,
                                                     special_kwargs, message):
    result = subprocess.run(serve_command(tiny_model_path, free_port(),
                                          special_kwargs),
                            capture_output=True,
                            text=True,
                            timeout=STARTUP_SECONDS,
                            env=server_env())
    assert result.returncode != 0
    assert message in result.stdout + result.stderr


def test_flag_is_listed_in_serve_help():
    result = subprocess.run([VLLM, "serve", "--help=VllmConfig"],
                            capture_output=True,
                            text=True,
                            timeout=STARTUP_SECONDS,
                            env=server_env())
    assert result.returncode == 0
    assert "--special-kwargs" in result.stdout
    assert "Sequence hooks:" in result.stdout
