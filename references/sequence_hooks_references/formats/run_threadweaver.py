# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Runs ThreadWeaver's controller on stock vLLM in a process of its own
and writes the rollouts as JSON (a test process may already hold a V1
engine, and a second one in a process computes wrong logits).

Usage (in .venv-v1): python -m
    sequence_hooks_references.formats.run_threadweaver MODEL CASES.json
    OUT.json [--url URL]

CASES.json is a list of cases, each ``{"name", "prompts": [text],
"settings": {controller keyword arguments}, "sampling": {...}, "n": 1}``.
Offline (``LLM``, fp32, eager) unless ``--url`` names a ``vllm serve`` of
MODEL. With ``n`` > 1, each prompt is also sent once to stock vLLM with
its first sample's first call's parameters and ``n``: ``"stock_n"`` has,
per prompt, the ``n`` samples' first calls' ids and stock vLLM's ``n``
samples' ids.
"""

import argparse
import dataclasses
import json
import os
from pathlib import Path

from sequence_hooks_references.formats.backends import Recorded
from sequence_hooks_references.formats.threadweaver_controller import (
    ThreadWeaverController, run)


def backend_for(model: str, url=None, max_model_len: int = 512):
    """Stock vLLM over MODEL: served at ``url``, else offline."""
    from sequence_hooks_references.formats.backends import (HTTPBackend,
                                                            LLMBackend)
    if url:
        return HTTPBackend(url)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    return LLMBackend(
        LLM(model=model,
            max_model_len=max_model_len,
            enforce_eager=True,
            dtype="float32",
            seed=0))


def run_cases(backend, tokenizer, cases: list[dict]) -> list[dict]:
    """Every case's rollouts, as JSON-ready dicts."""
    results = []
    for case in cases:
        controller = ThreadWeaverController(tokenizer,
                                            **case.get("settings", {}))
        prompts = [
            tokenizer.encode(p, add_special_tokens=False)
            for p in case["prompts"]
        ]
        n = case.get("n", 1)
        recorded = Recorded(backend)
        rollouts = run(controller, recorded, prompts, case.get("sampling"), n)
        result = {
            "name": case["name"],
            "rollouts":
            [[dataclasses.asdict(r) for r in per] for per in rollouts],
        }
        if n > 1:
            result["stock_n"] = [
                stock_n(backend, recorded.calls[k * n:(k + 1) * n])
                for k in range(len(prompts))
            ]
        results.append(result)
    return results


def stock_n(backend, first_calls: list) -> dict[str, list[list[int]]]:
    """One prompt's samples' first calls (the first step's, one per
    sample), and stock vLLM's samples of one request with the first
    sample's parameters and as many samples."""
    prompt, params, _ = first_calls[0]
    return {
        "first_calls": [done.token_ids for _, _, done in first_calls],
        "stock": backend.samples(prompt, dict(params, n=len(first_calls))),
    }


def runner_parser(doc: str) -> argparse.ArgumentParser:
    """The command line of a controller's runner: MODEL CASES.json
    OUT.json [--url URL] (``doc``: the runner's docstring)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("cases", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--url")
    return parser


def main() -> None:
    args = runner_parser(__doc__).parse_args()
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    backend = backend_for(args.model, args.url)
    results = run_cases(backend, tokenizer, json.loads(args.cases.read_text()))
    args.out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
