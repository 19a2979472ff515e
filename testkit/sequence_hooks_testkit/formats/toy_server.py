# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm serve` of a format's toy model on V1, as its tests and benchmark
start it: fp32, eager, seed 0, a window of 512 unless given; stock, or
with the plugin's flags among ``extra_args`` (`toy_server` for a block,
`start_toy_server` for its caller to stop; `start_format_server` with
a format in-engine, as the V1 suite shares it). `choices` reads an OpenAI
answer, whole or streamed; `held_out_prompts` a toy's prompts."""

import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests

from sequence_hooks_testkit.server import (Started, free_port, spawn_logged,
                                           stop_server, wait_healthy)

MAX_MODEL_LEN = 512
MODELS = Path(__file__).resolve().parents[3] / "models"
# Each format's served toy as the V1 suite shares it (`format_server`):
# its folder, its window (APR's searches are longer) and its chat
# template. The toys have none of their own: the server's renders the
# user's message as it is (after the BOS APR's controller sends), so a
# chat prompt is the completions prompt's text.
FORMAT_TOYS = {
    "threadweaver":
    (MODELS / "threadweaver-toy", 512, "{{ messages[0]['content'] }}"),
    "apr":
    (MODELS / "apr-toy", 2048, "{{ bos_token }}{{ messages[0]['content'] }}"),
    "npr": (MODELS / "npr-toy", 512, "{{ messages[0]['content'] }}"),
    "multiverse":
    (MODELS / "multiverse-toy", 512, "{{ messages[0]['content'] }}"),
}
# KV blocks of the splicing formats' servers: small, so that paths start
# inside blocks (a join then copies tokens).
SPLICE_BLOCK_SIZE = 32
# More of each format's server flags: the splicing formats' block size,
# and the prompt's cached tokens in its usage (a spliced answer's blocks
# must never be another prompt's hit).
SERVE_FLAGS = {
    name:
    ("--block-size", str(SPLICE_BLOCK_SIZE), "--enable-prompt-tokens-details")
    for name in ("npr", "multiverse")
}
# More children a fork than the defaults, so that a prompt with many
# labels forks each one, as the controllers do. The toys' own prompts
# fork fewer: their answers are the same under the defaults.
CHILD_LIMITS = {
    "max_children_per_sequence": 64,
    "max_children_per_request": 256
}


def held_out_prompts(model: Path, count: int) -> list[str]:
    """The first ``count`` of a toy's held-out prompts (the ``prompt`` of
    each line of its prompts.jsonl)."""
    lines = (model / "prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:count]]


def start_toy_server(model: Path,
                     log: Path,
                     extra_args: Sequence[str] = (),
                     kv_cache_gib: int = 1,
                     start_timeout_s: float = 900,
                     max_model_len: int = MAX_MODEL_LEN) -> Started:
    """Starts a server of ``model`` and waits until it is healthy.

    Args:
        model: The model's folder.
        log: Where its output goes.
        extra_args: More `vllm serve` arguments (``--special-kwargs``...).
        kv_cache_gib: Its KV cache (`VLLM_CPU_KVCACHE_SPACE`).
        start_timeout_s: How long it may take to become healthy.
        max_model_len: Its context window.

    Returns:
        The healthy server: its process, base URL and log.
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
    except BaseException:
        stop_server(process)
        raise
    return Started(process, url, log)


def start_format_server(name: str, log: Path) -> Started:
    """`vllm serve` of format ``name``'s toy with the format in-engine, as
    a user starts it (`--special-kwargs '{"format": ...}'`), with
    `CHILD_LIMITS`, the chat template of `FORMAT_TOYS` and the format's
    `SERVE_FLAGS`.

    Args:
        name: The format, a key of `FORMAT_TOYS`.
        log: Where the server's output goes.

    Returns:
        The healthy server (`start_toy_server`).
    """
    model, window, chat_template = FORMAT_TOYS[name]
    return start_toy_server(
        model,
        log, ("--special-kwargs", json.dumps({
            "format": name,
            **CHILD_LIMITS
        }), "--chat-template", chat_template, *SERVE_FLAGS.get(name, ())),
        max_model_len=window)


@contextmanager
def toy_server(model: Path,
               log: Path,
               extra_args: Sequence[str] = (),
               kv_cache_gib: int = 1,
               start_timeout_s: float = 900,
               max_model_len: int = MAX_MODEL_LEN) -> Iterator[str]:
    """A running server of ``model`` (`start_toy_server`); its base URL.
    Stopped on leaving."""
    server = start_toy_server(model, log, extra_args, kv_cache_gib,
                              start_timeout_s, max_model_len)
    try:
        yield server.url
    finally:
        stop_server(server.process)


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
