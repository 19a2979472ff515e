# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm serve` of a format's toy model on V1, as its tests and benchmark
start it: fp32, eager, seed 0, a window of 512; stock, or with the
plugin's flags among ``extra_args``."""

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from sequence_hooks_testkit.server import (spawn_logged, stop_server,
                                           wait_healthy)
from sequence_hooks_testkit.v1_server import free_port

MAX_MODEL_LEN = 512


@contextmanager
def toy_server(model: Path,
               log: Path,
               extra_args: Sequence[str] = (),
               kv_cache_gib: int = 1,
               start_timeout_s: float = 900) -> Iterator[str]:
    """A running server of ``model``; its base URL. Stopped on leaving.

    Args:
        model: The model's folder.
        log: Where its output goes.
        extra_args: More `vllm serve` arguments (``--special-kwargs``...).
        kv_cache_gib: Its KV cache (`VLLM_CPU_KVCACHE_SPACE`).
        start_timeout_s: How long it may take to become healthy.
    """
    port = free_port()
    process = spawn_logged([
        str(Path(sys.executable).with_name("vllm")), "serve",
        str(model), "--host", "127.0.0.1", "--port",
        str(port), "--max-model-len",
        str(MAX_MODEL_LEN), "--enforce-eager", "--dtype", "float32", "--seed",
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
