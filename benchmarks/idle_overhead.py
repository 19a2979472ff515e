# SPDX-License-Identifier: Apache-2.0
"""Idle overhead: the same hook-free workload with and without hooks.

Runs a batch of plain requests (no special token is ever sampled: hook
tokens are banned) on two engines over the tiny test model, one with
`special_kwargs` set and one stock with the same scheduling options,
alternating runs so both see the same machine state. Reports the per-step
time of each and their ratio; prints a table and writes JSON.

Usage: .venv/bin/python benchmarks/idle_overhead.py [--requests 32]
    [--tokens 64] [--repeats 5] [--out idle_overhead.json]
"""

import argparse
import statistics
import time

from tiny_setup import prepare, report


class BanTokens:
    """Keeps the given tokens from ever being sampled."""

    def __init__(self, token_ids):
        self.token_ids = list(token_ids)

    def __call__(self, output_ids, logits):
        logits[self.token_ids] = -float("inf")
        return logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="idle_overhead.json")
    args = parser.parse_args()
    ids, _, model = prepare()
    from engines import tiny_llm
    from tiny_model import SPECIAL_TOKENS

    from vllm import SamplingParams

    # The stock engine gets the scheduling options hooks turn on (chunked
    # prefill, no async output processing), so the ratio is the hooks' own.
    engines = {
        "hooks":
        tiny_llm(model, ids),
        "stock":
        tiny_llm(model,
                 enable_chunked_prefill=True,
                 disable_async_output_proc=True)
    }
    prompts = [f"the cat sees {w}"
               for w in ("dog", "bird", "fish", "tree")] * (args.requests // 4)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=args.tokens,
        ignore_eos=True,
        logits_processors=[BanTokens(range(len(SPECIAL_TOKENS)))])
    samples = {name: [] for name in engines}
    for name, llm in engines.items():  # warm-up
        llm.generate(prompts, params, use_tqdm=False)
    for _ in range(args.repeats):
        for name, llm in engines.items():
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            assert all(o.promise_tree is None for o in outputs)
            # `tokens` steps: the prefill samples the first token.
            samples[name].append(elapsed / args.tokens)
    ms_per_step = {
        name: round(statistics.median(values) * 1e3, 3)
        for name, values in samples.items()
    }
    summary = {
        "requests": len(prompts),
        "tokens": args.tokens,
        "hooks_ms_per_step": ms_per_step["hooks"],
        "stock_ms_per_step": ms_per_step["stock"],
        "ratio": round(ms_per_step["hooks"] / ms_per_step["stock"], 3),
    }
    report([summary], args.out)


if __name__ == "__main__":
    main()
