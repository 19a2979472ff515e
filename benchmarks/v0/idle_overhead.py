# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Idle overhead: the same hook-free workload with and without hooks.

Runs a batch of plain requests (no special token is ever sampled: hook
tokens are banned) on engines over the tiny test model with `special_kwargs`
set and on stock engines with the same scheduling options, two of each,
alternating runs in rotating order so all see the same machine state.
Reports the per-step time of each kind (pooled over its two engines), their
ratio, and each kind's engine-to-engine ratio as the noise to read it in;
prints a table and writes JSON.

Usage: .venv/bin/python benchmarks/idle_overhead.py [--requests 32]
    [--tokens 128] [--repeats 9] [--out idle_overhead.json]
"""

import argparse
import statistics
import time

from sequence_hooks_bench.runs import prepare, report
from sequence_hooks_testkit.tiny_model import SPECIAL_TOKENS


class BanTokens:
    """Logits processor that keeps the given tokens from being sampled."""

    def __init__(self, token_ids):
        # The banned token ids.
        self.token_ids = list(token_ids)

    def __call__(self, output_ids, logits):
        logits[self.token_ids] = -float("inf")
        return logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="idle_overhead.json")
    args = parser.parse_args()
    ids, _, model = prepare()
    from sequence_hooks_testkit.engines import tiny_llm
    from vllm import SamplingParams

    # The stock engines get the scheduling options hooks turn on (chunked
    # prefill, no async output processing), so the ratio is the hooks' own.
    stock_options = dict(enable_chunked_prefill=True,
                         disable_async_output_proc=True)
    # Two engines of each kind, created alternately: engine instances of
    # the same kind differ by a few percent on this machine (where their
    # memory landed), which pooling both evens out.
    engines = {}
    for instance in (1, 2):
        engines[f"hooks {instance}"] = tiny_llm(model, ids)
        engines[f"stock {instance}"] = tiny_llm(model, **stock_options)
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
    names = list(engines)
    for repeat in range(args.repeats):
        # Every engine runs at every position of the order equally often.
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            outputs = engines[name].generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            assert all(o.promise_tree is None for o in outputs)
            # `tokens` steps: the prefill samples the first token.
            samples[name].append(elapsed / args.tokens * 1e3)

    def ms_per_step(prefix: str) -> float:
        pooled = [
            v for name in names if name.startswith(prefix)
            for v in samples[name]
        ]
        return round(statistics.median(pooled), 3)

    per_instance = {
        name: round(statistics.median(samples[name]), 3)
        for name in names
    }
    summary = {
        "requests":
        len(prompts),
        "tokens":
        args.tokens,
        "hooks_ms_per_step":
        ms_per_step("hooks"),
        "stock_ms_per_step":
        ms_per_step("stock"),
        "ratio":
        round(ms_per_step("hooks") / ms_per_step("stock"), 3),
        # Same-kind instances' ratio: the noise the ratio is to be read in.
        "stock_2_over_1":
        round(per_instance["stock 2"] / per_instance["stock 1"], 3),
        "hooks_2_over_1":
        round(per_instance["hooks 2"] / per_instance["hooks 1"], 3),
        **{
            f"{name} ms": value
            for name, value in per_instance.items()
        },
    }
    report([summary], args.out)


if __name__ == "__main__":
    main()
