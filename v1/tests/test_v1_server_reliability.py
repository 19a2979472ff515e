# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The hooked V1 server as an operator sees it, black-box: bad requests,
clients that leave mid-stream and while their parent waits at a `<sync>`,
32 and 64 streams at once on a KV pool too small for them. Whatever
happens, the server stays up and, once idle, holds nothing: no request
running or waiting, no KV block in use, no live child, no parked parent.
"""

import asyncio
import json

import httpx
import pytest
import requests

from sequence_hooks_testkit.v1_server import (REQUEST_TIMEOUT_S, assert_idle,
                                              hooked_v1_server, metrics,
                                              scripted_body)

# KV pool: 16 blocks of 32 tokens (V1's CPU attention takes multiples of
# 32 only), 15 usable; one tree of the load grows to about 5, so 32 or 64
# at once wait for blocks. Each load also runs one wide tree
# (`wide_tree_plans`) that alone needs more than the pool, so running
# members are preempted whatever the arrival order (the test asserts the
# preemption counter rose; the gauges are not read reliably while the
# server streams).
POOL = ("--block-size", "32", "--num-gpu-blocks-override", "16",
        "--max-num-seqs", "256")
IDLE_TIMEOUT_S = 90
PREEMPTIONS = "vllm:num_preemptions_total"


@pytest.fixture(scope="module")
def server(tiny_model_path, hook_ids, tmp_path_factory):
    with hooked_v1_server(tiny_model_path, tmp_path_factory.mktemp("serve"),
                          POOL) as url:
        # vLLM's own gauges show on /metrics once set: a first request
        # sets them, so that every idle check reads them (`assert_idle`
        # fails on a metric that is not there).
        requests.post(url + "/v1/completions",
                      json=scripted_body(tree_plans(hook_ids, 0), hook_ids,
                                         tiny_model_path, False),
                      timeout=REQUEST_TIMEOUT_S).raise_for_status()
        yield url


def assert_idle_and_healthy(url: str, hook_ids, model_path) -> None:
    """Polls until the server holds nothing, then serves a hooked request."""
    assert_idle(url, IDLE_TIMEOUT_S)
    assert requests.get(url + "/health", timeout=10).status_code == 200
    answer = requests.post(url + "/v1/completions",
                           json=scripted_body(tree_plans(hook_ids, 0),
                                              hook_ids, model_path, False),
                           timeout=REQUEST_TIMEOUT_S)
    assert answer.status_code == 200
    assert answer.json()["kv_transfer_params"]["promise_tree"]["children"]


def tree_plans(hook_ids, index: int, long_children: bool = False) -> dict:
    """A word, two promises, a sync, four words; children of 30-48 tokens,
    which cross a block boundary as they decode (long ones: 150, so the
    parent stays parked)."""
    P, S = hook_ids.promise, hook_ids.sync
    first = 150 if long_children else 30 + index % 9
    second = 150 if long_children else 40 + index % 9
    return {
        (): [None, P, P, S] + [None] * 4,
        (0, ): [None] * first,
        (1, ): [None] * second,
    }


def wide_tree_plans(hook_ids) -> dict:
    """A word, six promises, a sync, four words; six children of 150
    tokens (five blocks each: 30 blocks at once, twice the pool)."""
    P, S = hook_ids.promise, hook_ids.sync
    plans = {(): [None] + [P] * 6 + [S] + [None] * 4}
    plans.update({(i, ): [None] * 150 for i in range(6)})
    return plans


@pytest.mark.parametrize(
    "request_body, status", [
        ("{not json", 400),
        (json.dumps({
            "model": "no-such-model",
            "prompt": "a"
        }), 404),
        (json.dumps({
            "prompt": "a",
            "max_tokens": -1
        }), 400),
        (json.dumps({
            "prompt": "the " * 300,
            "max_tokens": 4
        }), 400),
        (json.dumps({
            "prompt": "a",
            "n": 0
        }), 400),
    ],
    ids=["bad-json", "unknown-model", "negative-max", "too-long", "n-zero"])
def test_a_bad_request_gets_a_4xx_and_the_server_serves_on(
        server, hook_ids, tiny_model_path, request_body, status):
    if '"model"' not in request_body and request_body.startswith("{\""):
        request_body = json.dumps({
            "model": str(tiny_model_path),
            **json.loads(request_body)
        })
    response = requests.post(server + "/v1/completions",
                             data=request_body,
                             headers={"Content-Type": "application/json"},
                             timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == status, response.text
    assert_idle_and_healthy(server, hook_ids, tiny_model_path)


async def one_stream(client: httpx.AsyncClient, url: str, body: dict,
                     leave_after: int) -> str:
    """Streams one request; leaves after ``leave_after`` chunks (0: reads
    to the end). Returns how it ended."""
    chunks = 0
    async with client.stream("POST", url + "/v1/completions",
                             json=body) as response:
        if response.status_code != 200:
            return f"HTTP {response.status_code}"
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "done"
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                return f"error {chunk['error']}"
            chunks += 1
            if leave_after and chunks >= leave_after:
                return "left"
    return "torn"


@pytest.mark.parametrize("in_flight", [32, 64])
def test_streams_that_leave_mid_stream_and_at_a_sync_leave_nothing(
        server, hook_ids, tiny_model_path, in_flight):
    """A quarter leave after two chunks (mid-stream), a quarter leave
    while their parent is parked (children of 150 tokens), the rest read
    to the end; all at once on the small pool, with a wide tree that
    alone overflows it (read to the end)."""

    async def load() -> list[str]:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S * 4) as client:
            streams = []
            for index in range(in_flight):
                kind = index % 4
                body = scripted_body(tree_plans(hook_ids, index, kind == 1),
                                     hook_ids,
                                     tiny_model_path,
                                     True,
                                     max_tokens=200)
                streams.append(
                    one_stream(client, server, body, {
                        0: 2,
                        1: 1
                    }.get(kind, 0)))
            wide = scripted_body(wide_tree_plans(hook_ids),
                                 hook_ids,
                                 tiny_model_path,
                                 True,
                                 max_tokens=200)
            streams.append(one_stream(client, server, wide, 0))
            return await asyncio.gather(*streams)

    preempted = metrics(server, [PREEMPTIONS])[PREEMPTIONS]
    endings = asyncio.run(load())
    # The pressure was real: running requests were preempted for blocks
    # (a counter, read reliably once the streams ended; children's
    # preemptions count as their root's).
    assert metrics(server, [PREEMPTIONS])[PREEMPTIONS] > preempted
    expected = [
        "left" if index % 4 in (0, 1) else "done" for index in range(in_flight)
    ] + ["done"]
    assert endings == expected
    assert_idle_and_healthy(server, hook_ids, tiny_model_path)
