# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Load check: concurrent streamed promise/sync requests against a server.

Starts `vllm serve` with sequence hooks on the tiny test model (or uses a
running server given by --base-url, on a loopback address only), sends N
streamed completions with a scripted promise/sync program, a share of
whose clients disconnect after their first chunks, and reports requests
completed, errors, p50/p99 latency, and the KV usage once the server is
idle again. Every loop is bounded in count and time.

Usage: .venv/bin/python benchmarks/load_check.py [--requests 48]
    [--concurrency 12] [--disconnect-fraction 0.25] [--base-url URL]
"""

import argparse
import asyncio
import ipaddress
import json
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from sequence_hooks_testkit.server import (SCRIPTED_PATTERN, running_server,
                                           scripted_request_body)
from sequence_hooks_testkit.tiny_model import (HookIds, build_tiny_model,
                                               tiny_hook_ids)

KV_USAGE = "vllm:sequence_hook_kv_cache_usage_perc"
REQUEST_TIMEOUT = 120.0


def loopback_only(url: str) -> str:
    host = urlsplit(url).hostname or ""
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise SystemExit(f"{url}: this check only targets loopback hosts")
    return url.rstrip("/")


def request_body(model: str, ids: HookIds, index: int) -> dict:
    """Parent: a word, two promises, sync, four words; children: 8-24."""
    P, S = ids.promise, ids.sync
    plans = {
        (): [None, P, P, S] + [None] * 4,
        (0, ): [None] * (8 + index % 9),
        (1, ): [None] * (16 + index % 9),
    }
    return {
        "model": model,
        "prompt": "the cat sees",
        "max_tokens": 96,
        "temperature": 0.0,
        "stream": True,
        **scripted_request_body(plans, ids),
    }


async def one_request(client, base, body, disconnect: bool) -> dict:
    start = time.monotonic()
    chunks = 0
    async with client.stream("POST", f"{base}/v1/completions",
                             json=body) as response:
        if response.status_code != 200:
            return {"error": f"HTTP {response.status_code}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunks += 1
            if disconnect and chunks >= 2:
                return {"disconnected": True}
    return {"latency": time.monotonic() - start, "chunks": chunks}


async def run_load(base, model, ids, requests, concurrency, disconnect_every):
    limit = asyncio.Semaphore(concurrency)
    timeout = httpx.Timeout(REQUEST_TIMEOUT)

    async def guarded(index, client):
        async with limit:
            try:
                return await asyncio.wait_for(
                    one_request(
                        client, base, request_body(model, ids, index),
                        disconnect_every and index % disconnect_every == 0),
                    REQUEST_TIMEOUT)
            except (httpx.HTTPError, asyncio.TimeoutError) as e:
                return {"error": type(e).__name__}

    async with httpx.AsyncClient(timeout=timeout) as client:
        return await asyncio.gather(*(guarded(i, client)
                                      for i in range(requests)))


def metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--disconnect-fraction", type=float, default=0.25)
    parser.add_argument("--base-url",
                        help="a running server (loopback only) started "
                        "with the hooks and --logits-processor-pattern "
                        f"'{SCRIPTED_PATTERN}'; default: start one")
    parser.add_argument("--model", help="served model name (--base-url)")
    args = parser.parse_args()
    ids = tiny_hook_ids()
    with tempfile.TemporaryDirectory() as folder, ExitStack() as stack:
        if args.base_url:
            base, model = loopback_only(args.base_url), args.model
        else:
            model = str(build_tiny_model(Path(folder) / "model"))
            base = stack.enter_context(
                running_server(model,
                               Path(folder) / "server.log",
                               extra=["--disable-log-requests"]))
        disconnect_every = (round(1 / args.disconnect_fraction)
                            if args.disconnect_fraction > 0 else 0)
        started = time.monotonic()
        results = asyncio.run(
            run_load(base, model, ids, args.requests, args.concurrency,
                     disconnect_every))
        wall = time.monotonic() - started
        deadline = time.monotonic() + 60
        while (metric(base, "vllm:num_requests_running") > 0
               and time.monotonic() < deadline):
            time.sleep(0.5)
        kv_usage = metric(base, KV_USAGE)
        live_children = metric(base, "vllm:sequence_hook_children_running")
        spawned = metric(base, "vllm:sequence_hook_promises_spawned_total")
    latencies = sorted(r["latency"] for r in results if "latency" in r)
    report = {
        "requests":
        args.requests,
        "concurrency":
        args.concurrency,
        "completed":
        len(latencies),
        "disconnected":
        sum(1 for r in results if r.get("disconnected")),
        "errors":
        sum(1 for r in results if "error" in r),
        "p50_latency_s":
        round(statistics.median(latencies), 3) if latencies else None,
        "p99_latency_s":
        round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
              3) if latencies else None,
        "wall_s":
        round(wall, 2),
        "children_spawned":
        spawned,
        "children_alive_at_end":
        live_children,
        "kv_usage_at_end":
        kv_usage,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
