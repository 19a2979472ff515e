# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm serve` of a format's toy model on V1, as its tests and benchmark
start it: fp32, eager, seed 0, a window of 512 unless given; stock, or
with the plugin's flags among ``extra_args``. `choices` reads an OpenAI
answer, whole or streamed; `held_out_prompts` a toy's prompts."""

import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests

from sequence_hooks_testkit.server import (spawn_logged, stop_server,
                                           wait_healthy)
from sequence_hooks_testkit.v1_server import free_port

MAX_MODEL_LEN = 512


def held_out_prompts(model: Path, count: int) -> list[str]:
    """The first ``count`` of a toy's held-out prompts (the ``prompt`` of
    each line of its prompts.jsonl)."""
    lines = (model / "prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:count]]


@contextmanager
def toy_server(model: Path,
               log: Path,
               extra_args: Sequence[str] = (),
               kv_cache_gib: int = 1,
               start_timeout_s: float = 900,
               max_model_len: int = MAX_MODEL_LEN) -> Iterator[str]:
    """A running server of ``model``; its base URL. Stopped on leaving.

    Args:
        model: The model's folder.
        log: Where its output goes.
        extra_args: More `vllm serve` arguments (``--special-kwargs``...).
        kv_cache_gib: Its KV cache (`VLLM_CPU_KVCACHE_SPACE`).
        start_timeout_s: How long it may take to become healthy.
        max_model_len: Its context window.
    """
    port = free_port()
    process = spawn_logged([
        str(Path(sys.executable).with_name("vllm")), "serve",
        str(model), "--host", "127.0.0.1", "--port",
        str(port), "--max-model-len",
        str(max_model_len), "--enforce-eager", "--dtype", "float32", "--seed",
        "0", "--gpu-memory-utilization", "0.05", *extra_args
    ],
                           log,
                           env=dict(os.environ,
                                    VLLM_ENABLE_V1_MULTIPROCESSING="1",
                                    VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib)))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, log, start_timeout_s)
        yield url
    finally:
        stop_server(process)


def choices(url: str,
            path: str,
            body: dict[str, Any],
            timeout: float = 600) -> tuple[list[dict], dict]:
    """Posts an OpenAI request; its choices, every streamed chunk's in
    order when ``body["stream"]``, and the whole answer (the last chunk
    when streamed)."""
    stream = bool(body.get("stream"))
    response = requests.post(url + path,
                             json=body,
                             stream=stream,
                             timeout=timeout)
    response.raise_for_status()
    if not stream:
        answer = response.json()
        return answer["choices"], answer
    chunks = [
        json.loads(line[len(b"data: "):]) for line in response.iter_lines()
        if line.startswith(b"data: ") and line != b"data: [DONE]"
    ]
    return [c for chunk in chunks for c in chunk["choices"]], chunks[-1]
