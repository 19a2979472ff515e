# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fan-out latency on V1: the hook scheduler vs one sequential sequence.

The V1 twin of `benchmarks/fanout_latency.py` (hooks vs sequential sides),
same shapes and model: a parent writes `a` tokens, promises k children of
m words each (and EOS), syncs and writes n more (scripted, so k, m and n
are exact), on the tiny test model with a rotary table as long as the
longest run; the sequential side is one request generating the same
a + k*m + n tokens.
Both sides run on the same hooked engine (a second V1 engine in one process
computes wrong logits, see docs/v1.md), alternating side by side in every
repeat; every run applies the same scripted logits processor. fp32, KV
block size 128 (the CPU default), eager, engine core in process.

Reports median wall time, engine steps and the ideal speedup
(a + k*m + n) / (a + m + 1 + n). Prints a table and writes JSON.

Usage: .venv-v1/bin/python benchmarks/v1/fanout_latency_v1.py
    [--ks 1 2 4 8 16] [--ms 16 64] [--repeats 5] [--out results.json]
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

PREFIX_TOKENS = 8  # a
SUFFIX_TOKENS = 8  # n


def plans_for(ids, k: int, m: int, hooked: bool) -> dict:
    """The hooked fan-out's plans, or the sequential one's."""
    if not hooked:
        return {(): [None] * (PREFIX_TOKENS + k * m + SUFFIX_TOKENS)}
    plans = {
        (): [None] * PREFIX_TOKENS + [ids.promise] * k + [ids.sync] +
        [None] * SUFFIX_TOKENS
    }
    for i in range(k):
        plans[(i, )] = [None] * m
    return plans


def timed(llm, ids, plans, max_tokens: int) -> tuple:
    """One request over ``plans``: output, seconds, engine steps."""
    from sequence_hooks_testkit.v1_engines import scripted_params
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    first_step = scheduler.current_step
    start = time.perf_counter()
    [output] = llm.generate(["the cat sees"],
                            scripted_params(plans, ids, max_tokens=max_tokens),
                            use_tqdm=False)
    return (output, time.perf_counter() - start,
            scheduler.current_step - first_step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--ms", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="fanout_latency_v1.json")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm_sequence_hooks import promise_tree

    from sequence_hooks_testkit.tiny_model import (TinyModelSpec,
                                                   build_tiny_model,
                                                   tiny_hook_ids)
    from sequence_hooks_testkit.v1_engines import v1_llm

    # As benchmarks/fanout_latency.py sizes it.
    max_len = PREFIX_TOKENS + max(args.ks) * (max(args.ms) + 2) + 64
    model = build_tiny_model(
        Path(tempfile.mkdtemp()) / "tiny",
        TinyModelSpec(max_positions=max_len))
    ids = tiny_hook_ids()
    llm = v1_llm(model, ids, max_model_len=max_len, max_num_seqs=64)
    timed(llm, ids, plans_for(ids, 2, 8, True), max_len - 8)  # warm-up
    rows = []
    for m in args.ms:
        for k in args.ks:
            sides = {"hooks": [], "sequential": []}
            steps = {}
            for _ in range(args.repeats):
                for side in sides:  # alternating, side by side
                    output, seconds, n = timed(
                        llm, ids, plans_for(ids, k, m, side == "hooks"),
                        max_len - 8)
                    sides[side].append(seconds)
                    steps[side] = n
                    if side == "hooks":
                        tree = promise_tree(output)
                        assert [len(c.token_ids)
                                for c in tree.children] == [m + 1] * k
            a, n = PREFIX_TOKENS, SUFFIX_TOKENS
            hooks_s = statistics.median(sides["hooks"])
            sequential_s = statistics.median(sides["sequential"])
            ideal = (a + k * m + n) / (a + m + 1 + n)
            rows.append({
                "k": k,
                "m": m,
                "hooks_s": round(hooks_s, 4),
                "sequential_s": round(sequential_s, 4),
                "hooks_steps": steps["hooks"],
                "sequential_steps": steps["sequential"],
                "speedup": round(sequential_s / hooks_s, 2),
                "ideal_speedup": round(ideal, 2),
            })
            print(rows[-1], flush=True)
    report = {
        "engine": "vLLM 0.32 V1 + vllm_sequence_hooks",
        "dtype": "float32",
        "kv_block_size": llm.llm_engine.vllm_config.cache_config.block_size,
        "repeats": args.repeats,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("| " + " | ".join("---" for _ in columns) + " |")
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")


if __name__ == "__main__":
    main()
