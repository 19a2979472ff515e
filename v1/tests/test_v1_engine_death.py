# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An engine core killed mid-tree under data parallelism.

A hooked server with two engine cores (`--data-parallel-size 2`: the
suite's shared one, which test_v1_data_parallel.py loads first, taken
here) runs streamed trees pinned to each engine (a root that promises two
children of 150 tokens and syncs, every engine step that runs them slowed
so that no tree can finish before the kill); once every stream has
begun, `EngineCore_DP1` gets SIGKILL. What upstream vLLM does without
the plugin (measured side by side in docs/running-at-scale.md): the
death is fatal to the server, every open stream ends, the server exits
non-zero and leaves no process.
With hooks the same must hold: no stream hangs, none on the killed
engine ends as if its tree had finished, and nothing of the server's
process group is left.
"""

import contextlib
import json
import os
import signal
import threading

import psutil
import pytest
import requests

from sequence_hooks_testkit.shutdown_check import live_processes_of_group
from sequence_hooks_testkit.v1_server import REQUEST_TIMEOUT_S, scripted_body

# The shared servers its tests use (conftest's `shared_servers`).
pytestmark = pytest.mark.shares("data parallel")

ENGINES = 2
STREAMS_PER_ENGINE = 2
# Seconds added to each engine step that runs the trees: a tree needs
# more than 150 steps, so 8 seconds at least, and the kill comes once
# every stream has begun.
STEP_DELAY_S = 0.05
# How long the streams and the server may take to end after the kill
# (measured: 5 s for the streams, 18 s for the server, on a loaded
# machine).
ENDED_WITHIN_S = 120
KILLED = "EngineCore_DP1"


def tree_plans(hook_ids) -> dict:
    """A word, two promises, a sync, four words; children of 150 words."""
    return {
        ():
        [None, hook_ids.promise, hook_ids.promise, hook_ids.sync] + [None] * 4,
        (0, ): [None] * 150,
        (1, ): [None] * 150,
    }


def read_stream(url: str, body: dict, rank: int, begun: threading.Event,
                endings: dict, key: tuple) -> None:
    """Reads one streamed completion pinned to engine ``rank``; sets
    ``begun`` at its first chunk and records how it ended: its last
    finish reason, "error" for an error event, "cut" if the connection
    broke, None if it ended with neither."""
    ending = None
    try:
        with requests.post(url + "/v1/completions",
                           json=body,
                           headers={"X-data-parallel-rank": str(rank)},
                           stream=True,
                           timeout=REQUEST_TIMEOUT_S) as response:
            for line in response.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                begun.set()
                data = json.loads(line[len(b"data: "):])
                if "error" in data:
                    ending = "error"
                for choice in data.get("choices", ()):
                    ending = choice.get("finish_reason") or ending
    except requests.RequestException:
        ending = ending or "cut"
    finally:
        begun.set()
        endings[key] = ending


def engine_core(server: psutil.Process, name: str) -> psutil.Process:
    """The server's engine-core process called ``name`` (vLLM sets its
    title, `VLLM::EngineCore_DP<rank>`)."""
    found = []
    for child in server.children(recursive=True):
        try:
            if name in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            # Gone or a zombie: not a running engine core.
            continue
    [process] = found
    return process


def test_a_killed_engine_core_ends_every_stream_and_the_server(
        tiny_model_path, hook_ids, shared_servers):
    server = shared_servers.take("data parallel")
    process, url = server.process, server.url
    endings: dict = {}
    try:
        readers = []
        for rank in range(ENGINES):
            for index in range(STREAMS_PER_ENGINE):
                begun = threading.Event()
                body = scripted_body(tree_plans(hook_ids),
                                     hook_ids,
                                     tiny_model_path,
                                     True,
                                     max_tokens=200,
                                     step_delay_s=STEP_DELAY_S)
                reader = threading.Thread(target=read_stream,
                                          args=(url, body, rank, begun,
                                                endings, (rank, index)),
                                          daemon=True)
                reader.start()
                readers.append((reader, begun))
        for _, begun in readers:
            assert begun.wait(REQUEST_TIMEOUT_S), "a stream never began"
        assert not endings, f"a tree ended before the kill: {endings}"
        engine_core(psutil.Process(process.pid), KILLED).kill()
        for reader, _ in readers:
            reader.join(ENDED_WITHIN_S)
        hanging = [reader for reader, _ in readers if reader.is_alive()]
        assert not hanging, f"{len(hanging)} streams hang after the kill"
        exit_code = process.wait(ENDED_WITHIN_S)
        left = live_processes_of_group(process.pid, grace=ENDED_WITHIN_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    # As upstream: the death is fatal to the server.
    assert exit_code != 0
    assert not left, f"processes of the server's group left behind: {left}"
    # The killed engine's trees did not end as if finished.
    assert all(endings[(1, index)] not in ("stop", "length")
               for index in range(STREAMS_PER_ENGINE)), endings
