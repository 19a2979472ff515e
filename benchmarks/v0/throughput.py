# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Throughput: many concurrent hooked requests vs the same tokens as plain
requests.

Hooked side: N requests, each a parent that writes a words, promises k
children of m words, syncs and writes n more. Plain side, on a stock
engine: for each hooked request, the same token work as independent plain
requests (one of a + n tokens, k of m tokens over the same prompt). Both
use the same scripted logits processor. Reports generated words (hook
tokens and EOS not counted) per second of each, their ratio, and the
engine steps each side took (the same words in more steps means smaller
batches); prints a table and writes JSON. `--profile` then shows how much
of a hooked round the hook functions take.

Usage: .venv/bin/python benchmarks/throughput.py [--requests 32] [--k 4]
    [--m 32] [--repeats 3] [--out throughput.json] [--profile]
"""

import argparse
import cProfile
import pstats
import statistics
import time

from sequence_hooks_bench.runs import count_steps, free_params, prepare, report
from sequence_hooks_testkit.oracle import scripted
from sequence_hooks_testkit.tiny_model import SPECIAL_TOKENS

PREFIX_TOKENS = 8
SUFFIX_TOKENS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--m", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="throughput.json")
    parser.add_argument("--profile",
                        action="store_true",
                        help="then profile one hooked round and print the "
                        "hook functions' share")
    args = parser.parse_args()
    ids, _, model = prepare()
    from sequence_hooks_testkit.engines import tiny_llm

    def words(token_ids) -> int:
        # Special tokens (hooks, EOS) are not counted as generated output.
        return sum(t >= len(SPECIAL_TOKENS) for t in token_ids)

    from vllm import SamplingParams

    hooked = tiny_llm(model, ids)
    plain = tiny_llm(model,
                     enable_chunked_prefill=True,
                     disable_async_output_proc=True)
    a, n, k, m = PREFIX_TOKENS, SUFFIX_TOKENS, args.k, args.m
    plans = {(): [None] * a + [ids.promise] * k + [ids.sync] + [None] * n}
    for child in range(k):
        plans[(child, )] = [None] * m
    prompt = "the cat sees"

    hooked_params = SamplingParams(temperature=0.0,
                                   max_tokens=a + k + 1 + n + k * (m + 2) + 8,
                                   logits_processors=[scripted(plans, ids)])
    plain_prompts = ([prompt] + [prompt] * k) * args.requests
    plain_params = ([free_params(a + n, ids)] +
                    [free_params(m, ids)] * k) * args.requests
    hooked_steps, plain_steps = count_steps(hooked), count_steps(plain)
    samples = {"hooks": [], "plain": []}
    for _ in range(args.repeats + 1):  # the first round warms up
        hooked_steps[0] = plain_steps[0] = 0
        start = time.perf_counter()
        outputs = hooked.generate([prompt] * args.requests,
                                  hooked_params,
                                  use_tqdm=False)
        hooked_time = time.perf_counter() - start
        # Words generated: the parents' own and the children's.
        hooked_words = sum(
            words(o.outputs[0].token_ids) - o.promise_tree.num_merged_tokens +
            sum(words(c.token_ids) for c in o.promise_tree.children)
            for o in outputs)
        start = time.perf_counter()
        plain_outputs = plain.generate(plain_prompts,
                                       plain_params,
                                       use_tqdm=False)
        plain_time = time.perf_counter() - start
        plain_words = sum(words(o.outputs[0].token_ids) for o in plain_outputs)
        samples["hooks"].append(hooked_words / hooked_time)
        samples["plain"].append(plain_words / plain_time)
    summary = {
        "requests": args.requests,
        "children_per_request": k,
        "child_tokens": m,
        "hooks_words_per_s": round(statistics.median(samples["hooks"][1:])),
        "plain_words_per_s": round(statistics.median(samples["plain"][1:])),
        "hooks_steps": hooked_steps[0],
        "plain_steps": plain_steps[0],
        "hooks_words": hooked_words,
        "plain_words": plain_words,
    }
    summary["ratio"] = round(
        summary["hooks_words_per_s"] / summary["plain_words_per_s"], 3)
    report([summary], args.out)
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(hooked.generate, [prompt] * args.requests,
                        hooked_params,
                        use_tqdm=False)
        stats = pstats.Stats(profile).sort_stats("cumulative")
        print(f"\nprofiled hooked round: {stats.total_tt:.2f} s in all "
              "(cProfile slows everything; compare shares)")
        stats.print_stats(r"sequence_hook\.py.*\((_promise|_sync|_finish|"
                          r"_merge)\)")


if __name__ == "__main__":
    main()
