# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hooked `vllm serve` with several engine cores (data parallelism), and
what the tests compare of its answers.

`start_data_parallel_server` runs `v1_server`'s hooked server with
`--data-parallel-size N` (`--special-kwargs` loads the plugin's
`SamplesOnOneEngine` middleware); `held_by_engines` reads what the engine
cores hold from `/metrics` (vLLM's gauges per engine, the hooks' summed
over them). `answer` reads a completion or chat answer, streamed or not,
as texts and trees by choice index; `shape` is the part of a tree that
must not differ between engines.
"""

import json
import subprocess
from pathlib import Path
from typing import Any, Optional

import requests

from sequence_hooks_testkit.v1_server import (REQUEST_TIMEOUT_S,
                                              start_hooked_v1_server)

# Start of a server with two engine cores and two API servers: 3.5 to 4
# minutes measured on this 2-core machine while other suites ran.
START_TIMEOUT_S = 600
# vLLM's gauges of each engine core (labelled `engine`), by what they show.
ENGINE_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
}
# The hooks' gauges (one sample, the engine cores' sum).
HOOK_GAUGES = ("vllm:sequence_hook_children_running",
               "vllm:sequence_hook_parents_parked")


def start_data_parallel_server(
        model_path: Path,
        work_dir: Path,
        engines: int = 2,
        tensor_parallel: int = 1) -> tuple[subprocess.Popen, str]:
    """`v1_server.start_hooked_v1_server` with ``engines`` engine cores.

    Args:
        model_path: The tiny model's folder.
        work_dir: An empty folder for the log.
        engines: `--data-parallel-size`.
        tensor_parallel: `--tensor-parallel-size` of each engine core. The
            caller sets `VLLM_CPU_OMP_THREADS_BIND` for that many workers
            an engine: without it vLLM's CPU worker fails on NUMA binding.

    Returns:
        The server's process (the leader of its process group) and its
        base URL.
    """
    return start_hooked_v1_server(
        model_path,
        work_dir, ("--data-parallel-size", str(engines),
                   "--tensor-parallel-size", str(tensor_parallel)),
        start_timeout_s=START_TIMEOUT_S * tensor_parallel)


def by_engine(text: str, name: str) -> dict[str, float]:
    """A metric's value per engine core (its `engine` label; the samples
    of its other labels summed), from a `/metrics` text.

    Args:
        text: The text.
        name: The metric.

    Returns:
        Its value by engine label; empty if it has no sample.
    """
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.split("{", 1)[0].split(" ", 1)[0] == name:
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            values[engine] = values.get(engine, 0.0) + float(
                line.rsplit(" ", 1)[-1])
    return values


def held_by_engines(url: str) -> dict[str, Any]:
    """What the engine cores hold now, from one read of `/metrics`.

    Args:
        url: The server's base URL.

    Returns:
        "engines": vLLM's running and waiting requests and KV cache usage
        of each engine core (its `engine` label), and the hooks' gauges
        (children running, parents parked), which `/metrics` sums over
        the engine cores.

    Raises:
        KeyError: A gauge it reads has no sample (read as 0, it would
            pass any idle check), named.
    """
    text = requests.get(url + "/metrics", timeout=REQUEST_TIMEOUT_S).text
    engines: dict[str, dict[str, float]] = {}
    for name, what in ENGINE_GAUGES.items():
        for engine, value in by_engine(text, name).items():
            engines.setdefault(engine, {})[what] = value
    hooks: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in HOOK_GAUGES:
            hooks[name] = hooks.get(name, 0.0) + float(line.rsplit(" ", 1)[-1])
    shown = {what for values in engines.values() for what in values}
    missing = [n for n, what in ENGINE_GAUGES.items() if what not in shown]
    missing += [n for n in HOOK_GAUGES if n not in hooks]
    if missing:
        raise KeyError(f"not on /metrics: {', '.join(missing)}")
    return {"engines": engines, **hooks}


def shape(tree: dict[str, Any]) -> dict[str, Any]:
    """A tree without what differs from run to run (request ids, sums of
    floats).

    Args:
        tree: A tree as the answer carries it (`PromiseNode.to_dict`).

    Returns:
        Its texts, tokens, finish reasons, positions and merges, and its
        children's.
    """
    return {
        "text": tree["text"],
        "token_ids": tree["token_ids"],
        "finish_reason": tree["finish_reason"],
        "depth": tree["depth"],
        "fork_position": tree["fork_position"],
        "merged_spans": tree["merged_spans"],
        "children": [shape(child) for child in tree["children"]],
    }


def answer(url: str,
           request: dict[str, Any],
           rank: Optional[int] = None) -> dict[str, Any]:
    """A completion or chat answer by choice index.

    Args:
        url: The server's base URL.
        request: The body (`messages` for chat; `stream`, `n` read).
        rank: An engine to pin the request to (`X-data-parallel-rank`).

    Returns:
        "texts": each choice's text; if not streamed, "trees": each
        choice's tree's `shape` (a streamed answer carries none).
    """
    chat = "messages" in request
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    with requests.post(url +
                       ("/v1/chat/completions" if chat else "/v1/completions"),
                       json=request,
                       headers=headers,
                       stream=request["stream"],
                       timeout=REQUEST_TIMEOUT_S) as response:
        assert response.status_code == 200, response.text
        texts: dict[int, str] = {}
        if request["stream"]:
            for line in response.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                for choice in json.loads(line[len(b"data: "):])["choices"]:
                    texts[choice["index"]] = texts.get(choice["index"], "") + (
                        choice.get("text") or
                        (choice.get("delta") or {}).get("content") or "")
            return {"texts": texts}
        data = response.json()
    for choice in data["choices"]:
        texts[choice["index"]] = (choice["message"]["content"]
                                  if chat else choice["text"])
    params = data.get("kv_transfer_params") or {}
    if request.get("n", 1) == 1:
        trees = {0: shape(params["promise_tree"])}
    else:
        trees = {
            int(index): shape(tree)
            for index, tree in params.get("promise_trees", {}).items()
        }
    return {"texts": texts, "trees": trees}
