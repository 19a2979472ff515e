# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Memory: KV blocks in use during a k-child fan-out vs k independent
requests over the same context.

The parent's context is a long prompt; it promises k children at once and
parks; each child writes m tokens. The baseline sends k independent
requests whose prompt is that same context (no prefix caching), each
writing m tokens. Both run on the tiny test model with 16-token blocks;
the peak number of blocks in use is read from the block manager after
every engine step. Prints a table and writes JSON.

Usage: .venv/bin/python benchmarks/fanout_memory.py [--ks 1 2 4 8 16]
    [--context 256] [--m 32] [--out fanout_memory.json]
"""

import argparse
import json

from sequence_hooks_bench.runs import prepare, report, run_requests
from sequence_hooks_testkit.oracle import scripted

BLOCK_SIZE = 16


def peak_blocks(llm, requests):
    """Runs requests to the end, reading the blocks in use after each step.

    Args:
        llm: The `LLM` to run them on.
        requests: (request id, prompt, sampling params) triples.

    Returns:
        The peak number of KV blocks in use, and the final outputs by
        request id.
    """
    block_manager = llm.llm_engine.scheduler[0].block_manager
    total = block_manager.num_total_gpu_blocks
    peak = [0]

    def note_blocks_in_use():
        used = total - block_manager.get_num_free_gpu_blocks()
        peak[0] = max(peak[0], used)

    outputs = run_requests(llm, requests, note_blocks_in_use)
    return peak[0], outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--m", type=int, default=32)
    parser.add_argument("--out", default="fanout_memory.json")
    args = parser.parse_args()
    max_len = args.context + max(args.ks) + args.m + 64
    ids, tokenizer, model = prepare(max_positions=max_len)
    from sequence_hooks_testkit.engines import tiny_llm
    from vllm import SamplingParams

    common = dict(max_model_len=max_len, block_size=BLOCK_SIZE)
    hooked = tiny_llm(model, ids, **common)
    plain = tiny_llm(model, **common)
    context = ["the"] * args.context
    rows = []
    for k in args.ks:
        plans = {(): [ids.promise] * k + [ids.sync, None]}
        for child in range(k):
            plans[(child, )] = [None] * args.m
        fan_out, trees = peak_blocks(
            hooked,
            [(f"fan-{k}", " ".join(context),
              SamplingParams(temperature=0.0,
                             max_tokens=k * (args.m + 2) + 8,
                             logits_processors=[scripted(plans, ids)]))])
        children = trees[f"fan-{k}"].promise_tree.children
        assert len(children) == k
        assert all(len(c.text.split()) == args.m for c in children)
        tokens = tokenizer.encode(" ".join(context), add_special_tokens=False)
        independent, _ = peak_blocks(plain, [(f"ind-{k}-{i}", {
            "prompt_token_ids":
            tokens + [ids.promise, ids.child]
        }, SamplingParams(temperature=0.0, max_tokens=args.m, ignore_eos=True))
                                             for i in range(k)])
        row = {
            "k": k,
            "context_tokens": args.context,
            "child_tokens": args.m,
            "fan_out_peak_blocks": fan_out,
            "independent_peak_blocks": independent,
            "ratio": round(fan_out / independent, 3),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    report(rows, args.out)


if __name__ == "__main__":
    main()
