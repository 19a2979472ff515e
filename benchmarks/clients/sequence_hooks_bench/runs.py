# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the benchmarks share: the V0 CPU set-up, a tiny test model, runs and
reports."""

import argparse
import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from sequence_hooks_testkit.oracle import scripted
from sequence_hooks_testkit.tiny_model import (HookIds, TinyModelSpec,
                                               build_tiny_model,
                                               build_tokenizer, tiny_hook_ids)


def prepare(max_positions: Optional[int] = None):
    """Selects the V0 engine and builds a tiny model in a temporary folder.

    Args:
        max_positions: Rotary table length of the model; the kit's default
            if None.

    Returns:
        The hook token ids, the tokenizer and the model's folder.
    """
    os.environ.setdefault("VLLM_USE_V1", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    spec = (TinyModelSpec(
        max_positions=max_positions) if max_positions else TinyModelSpec())
    folder = tempfile.mkdtemp(prefix="tiny-model-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return tiny_hook_ids(), build_tokenizer(), build_tiny_model(
        Path(folder), spec)


def add_engine_options(parser: argparse.ArgumentParser,
                       model_help: str) -> None:
    """Adds the engine options every benchmark takes: ``--model`` and
    ``--dtype`` (float32 unless set: each figure states its dtype).

    Args:
        parser: The script's parser.
        model_help: ``--model``'s help: the model it names and its default.
    """
    parser.add_argument("--model", help=model_help)
    parser.add_argument("--dtype", default="float32")


def free_params(tokens: int, ids: HookIds):
    """Sampling parameters for a plain request on the benchmarks' terms.

    The scripted processor the hooked runs use lets the model choose every
    token (special tokens masked), so its per-token cost is the same on
    every side.

    Args:
        tokens: Tokens to generate.
        ids: The tiny tokenizer's hook token ids.

    Returns:
        Greedy `SamplingParams` for exactly ``tokens`` tokens.
    """
    from vllm import SamplingParams
    return SamplingParams(
        temperature=0.0,
        max_tokens=tokens,
        logits_processors=[scripted({(): [None] * tokens}, ids, role=())])


def count_steps(llm) -> list[int]:
    """Wraps the engine's step to count calls.

    Returns:
        A one-element list holding the count, which the caller may reset.
    """
    engine = llm.llm_engine
    counter = [0]
    step = engine.step

    def counting_step():
        counter[0] += 1
        return step()

    engine.step = counting_step
    return counter


def run_requests(llm, requests, after_step=None, max_steps: int = 20000):
    """Runs requests on ``llm``'s engine, step by step, until all finish.

    Args:
        llm: The `LLM` to run them on.
        requests: (request id, prompt, sampling params) triples.
        after_step: Called after every engine step, if given.
        max_steps: Steps after which a run that has not finished fails
            (instead of hanging).

    Returns:
        The final `RequestOutput` of each request, by request id.
    """
    engine = llm.llm_engine
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    outputs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
        if after_step is not None:
            after_step()
    raise RuntimeError(f"not finished after {max_steps} steps")


def report(rows: list[dict], out: str, columns=None) -> None:
    """Writes ``rows`` as JSON to ``out`` and prints a Markdown table.

    Args:
        rows: One dict per measured case.
        out: The JSON file to write.
        columns: The columns to print; all of the first row's if None.
    """
    Path(out).write_text(json.dumps(rows, indent=2))
    print_table(rows, columns)
    print(f"\nwrote {out}")


def print_table(rows: list[dict], columns=None) -> None:
    """Prints ``rows`` as a Markdown table.

    Args:
        rows: One dict per measured case.
        columns: The columns to print; all of the first row's if None.
    """
    columns = list(columns or rows[0])
    print("\n| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")
