# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The formats served as an operator sees them, black-box: each toy model
behind `vllm serve --special-kwargs '{"format": ...}'` on a KV pool too
small for its load, with bad requests and clients that leave as soon as
their stream opens or while the server runs sub-searches or threads.
Whatever happens, the server stays up and, once idle, holds nothing: no
request running or waiting, no KV block in use, no live child, no parked
parent; then it answers a search that forks.

The load is the toy's own held-out prompts, greedy, 16 at once: a quarter
leave once their stream opens, a quarter once the server shows a child
running (an APR root's output is held to its end, so its stream shows
nothing sooner), the rest read to the end.
"""

import asyncio
import json
from pathlib import Path
from typing import Optional

import httpx
import pytest
import requests

from sequence_hooks_testkit.formats.toy_server import choices, toy_server
from sequence_hooks_testkit.v1_server import assert_idle

MODELS = Path(__file__).resolve().parents[2] / "models"
# Per format: its toy, its window, the text before each prompt (APR's
# controller sends the model's BOS as text) and each call's budget.
FORMATS = {
    "threadweaver": (MODELS / "threadweaver-toy", 512, "", 400),
    "apr": (MODELS / "apr-toy", 2048, "<s>", 400),
}
# KV blocks beyond one window (the least a server starts with): fewer than
# 16 trees at once ask for, so the load also waits for blocks.
SPARE_BLOCKS = 8
IN_FLIGHT = 16
IDLE_TIMEOUT_S = 120
CHILDREN_RUNNING = "vllm:sequence_hook_children_running"


@pytest.fixture(scope="module", params=list(FORMATS))
def served(request, tmp_path_factory):
    """(format, URL, model, prompts) of a running server of the format's
    toy."""
    name = request.param
    model, window, before, _ = FORMATS[name]
    prompts = [
        before + json.loads(line)["prompt"]
        for line in (model / "prompts.jsonl").read_text().splitlines()
    ]
    pool = ("--block-size", "32", "--num-gpu-blocks-override",
            str(window // 32 + SPARE_BLOCKS), "--max-num-seqs", "256")
    with toy_server(model,
                    tmp_path_factory.mktemp(name) / "server.log",
                    ("--special-kwargs", json.dumps({"format": name}), *pool),
                    max_model_len=window) as url:
        served = name, url, model, prompts
        # vLLM's own gauges show on /metrics once set: a first search sets
        # them, so that every idle check reads them (`assert_idle` fails
        # on a metric that is not there).
        choices(url, "/v1/completions", body(served, prompts[0], False))
        yield served


def body(served, prompt: str, stream: bool) -> dict:
    name, _, model, _ = served
    return {
        "model": str(model),
        "prompt": prompt,
        "max_tokens": FORMATS[name][3],
        "temperature": 0.0,
        "stream": stream,
    }


def assert_idle_and_healthy(served) -> None:
    """Polls until the server holds nothing, then serves a search that
    forks (the first held-out prompt)."""
    _, url, _, prompts = served
    assert_idle(url, IDLE_TIMEOUT_S)
    assert requests.get(url + "/health", timeout=10).status_code == 200
    _, answer = choices(url, "/v1/completions", body(served, prompts[0],
                                                     False))
    assert answer["kv_transfer_params"]["promise_tree"]["children"]


# Bad requests (what changes in a good one) and the status each gets.
BAD_REQUESTS = [({
    "max_tokens": -1
}, 400), ({
    "n": 0
}, 400), ({
    "prompt": "1 " * 3000
}, 400), ({
    "model": "no-such-model"
}, 404)]


def test_bad_requests_get_a_4xx_and_the_server_serves_on(served):
    _, url, _, prompts = served
    for change, status in BAD_REQUESTS:
        response = requests.post(url + "/v1/completions",
                                 json={
                                     **body(served, prompts[1], False),
                                     **change
                                 },
                                 timeout=600)
        assert response.status_code == status, (change, response.text)
    assert_idle_and_healthy(served)


async def read_to_end(response: httpx.Response) -> str:
    """Reads a stream to its end; how it ended."""
    async for line in response.aiter_lines():
        if line == "data: [DONE]":
            return "done"
        if line.startswith("data: ") and "error" in json.loads(
                line[len("data: "):]):
            return f"error {line}"
    return "torn"


async def one_stream(client: httpx.AsyncClient, url: str, request: dict,
                     leave: Optional[asyncio.Event]) -> str:
    """Streams one request; leaves once ``leave`` is set (None: reads to
    the end). Returns how it ended."""
    async with client.stream("POST", url + "/v1/completions",
                             json=request) as response:
        if response.status_code != 200:
            return f"HTTP {response.status_code}"
        reading = asyncio.ensure_future(read_to_end(response))
        if leave is None:
            return await reading
        waiting = asyncio.ensure_future(leave.wait())
        done, _ = await asyncio.wait({reading, waiting},
                                     return_when=asyncio.FIRST_COMPLETED)
        if reading in done:
            waiting.cancel()
            return reading.result()
        reading.cancel()
        return "left"


async def children_seen(url: str, client: httpx.AsyncClient,
                        seen: asyncio.Event) -> None:
    """Sets ``seen`` once the server shows a child running."""
    while not seen.is_set():
        text = (await client.get(url + "/metrics")).text
        if any(
                line.startswith(CHILDREN_RUNNING)
                and float(line.rsplit(" ", 1)[1]) > 0
                for line in text.splitlines()):
            seen.set()
        await asyncio.sleep(0.1)


def test_clients_that_leave_at_once_and_mid_fork_leave_nothing(served):
    _, url, _, prompts = served

    async def load() -> tuple[list[str], bool]:
        async with httpx.AsyncClient(timeout=1800) as client:
            opened, seen = asyncio.Event(), asyncio.Event()
            opened.set()
            watcher = asyncio.ensure_future(children_seen(url, client, seen))
            streams = [
                one_stream(client, url,
                           body(served, prompts[i % len(prompts)], True),
                           [opened, seen, None, None][i % 4])
                for i in range(IN_FLIGHT)
            ]
            endings = await asyncio.gather(*streams)
            watcher.cancel()
            return endings, seen.is_set()

    endings, seen = asyncio.run(load())
    assert seen, "no child ran while the clients were there"
    for index, ending in enumerate(endings):
        expected = [{"left"}, {"left", "done"}, {"done"}, {"done"}][index % 4]
        assert ending in expected, (index, ending)
    assert_idle_and_healthy(served)
