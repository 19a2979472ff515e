# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fan-out latency: hooked fan-out vs sequential vs client-side join.

A parent writes `a` tokens, promises k children of m tokens each, syncs and
writes n more (scripted, so k, m and n are exact), on the tiny test model.
Side by side in one run, for each (k, m):

- hooks: one request on an engine with sequence hooks;
- sequential: one plain request generating the same a + k*m + n tokens;
- client join: the way APR/ThreadWeaver-style systems do it on a stock
  engine with prefix caching, run by the peer (`client_join`): the parent
  is streamed and generates its own promises and `<sync>` (no tokens for
  free); each `<promise>` it samples launches a child request at once over
  its context (the role marker appended, as the hooked child's); `<sync>`
  stops it, and one request goes out over the merged context when its
  children are done. The prefix cache is emptied before each join, so no
  join reuses an earlier run's blocks.

Every run applies the same scripted logits processor (hooks forced, the
rest free with special tokens masked), so its per-token cost is the same on
all three sides, and the stock engine gets the scheduling options hooks
turn on (chunked prefill, no async output processing). Each engine is
warmed up first.

Reports wall time, engine steps and the ideal speedup
(a + k*m + n) / (a + m + 1 + n); measured / ideal is the headline. Prints
a table and writes JSON.

Usage: .venv/bin/python benchmarks/fanout_latency.py [--ks 1 2 4 8 16]
    [--ms 16 64] [--repeats 5] [--out fanout_latency.json]
"""

import argparse
import json
import statistics
import time

from sequence_hooks.special_kwargs import SpecialKwargs
from sequence_hooks_bench.runs import count_steps, free_params, prepare, report
from sequence_hooks_references.client_join import run_joins, scripted_options
from sequence_hooks_testkit.oracle import scripted

PREFIX_TOKENS = 8  # a
SUFFIX_TOKENS = 8  # n
SIDES = ["hooks", "sequential", "client_join"]


def timed(llm, counter, prompts, params):
    """Generates and measures.

    Args:
        llm: The `LLM` to generate with.
        counter: ``llm``'s step counter (from `count_steps`).
        prompts: The prompts.
        params: Their sampling parameters.

    Returns:
        The outputs, the wall time in seconds and the engine steps.
    """
    counter[0] = 0
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, time.perf_counter() - start, counter[0]


def client_join(llm, counter, prompt: str, plans, max_tokens: int, ids):
    """The fan-out as a client does it on a stock engine: the peer
    (`client_join`), which streams the parent, launches a child request
    when the parent samples each `<promise>`, stops it at `<sync>` and
    sends one request over the merged context.

    Args:
        llm: A stock `LLM` with prefix caching.
        counter: ``llm``'s step counter (from `count_steps`).
        prompt: The parent's prompt.
        plans: The scripted program (the hooked run's).
        max_tokens: The request's budget.
        ids: The tiny tokenizer's hook token ids.

    Returns:
        The join's result, its wall time in seconds and its engine steps.
    """
    assert llm.reset_prefix_cache()
    prompt_ids = llm.get_tokenizer().encode(prompt)
    counter[0] = 0
    start = time.perf_counter()
    [result] = run_joins(llm.llm_engine, [prompt_ids],
                         max_tokens,
                         SpecialKwargs(sync_token_id=ids.sync,
                                       promise_token_id=ids.promise,
                                       child_role_token_id=ids.child),
                         [scripted_options(plans, ids)],
                         defaults={"temperature": 0.0})
    return result, time.perf_counter() - start, counter[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--ms", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="fanout_latency.json")
    args = parser.parse_args()
    max_len = PREFIX_TOKENS + max(args.ks) * (max(args.ms) + 2) + 64
    ids, _, model = prepare(max_positions=max_len)
    from sequence_hooks_testkit.engines import tiny_llm
    from vllm import SamplingParams

    hooked = tiny_llm(model, ids, max_model_len=max_len)
    plain = tiny_llm(model,
                     max_model_len=max_len,
                     enable_prefix_caching=True,
                     enable_chunked_prefill=True,
                     disable_async_output_proc=True)
    hooked_steps, plain_steps = count_steps(hooked), count_steps(plain)
    prompt = "the cat sees"

    for llm in (hooked, plain):
        llm.generate([prompt] * 4, free_params(32, ids), use_tqdm=False)
    rows = []
    for m in args.ms:
        for k in args.ks:
            a, n = PREFIX_TOKENS, SUFFIX_TOKENS
            plans = {
                (): [None] * a + [ids.promise] * k + [ids.sync] + [None] * n
            }
            for child in range(k):
                plans[(child, )] = [None] * m
            total = a + k * m + n
            runs = {name: [] for name in SIDES}
            texts: dict[str, str] = {}
            for repeat in range(args.repeats):
                # Alternating sides: each repeat starts with the next one.
                for name in SIDES[repeat % 3:] + SIDES[:repeat % 3]:
                    if name == "hooks":
                        [out], wall, steps = timed(
                            hooked, hooked_steps, [prompt],
                            SamplingParams(
                                temperature=0.0,
                                max_tokens=max_len - 8,
                                logits_processors=[scripted(plans, ids)]))
                        children = out.promise_tree.children
                        assert len(children) == k
                        assert all(len(c.text.split()) == m for c in children)
                        texts[name] = out.outputs[0].text
                    elif name == "sequential":
                        _, wall, steps = timed(plain, plain_steps, [prompt],
                                               free_params(total, ids))
                    else:
                        joined, wall, steps = client_join(
                            plain, plain_steps, prompt, plans, max_len - 8,
                            ids)
                        texts[name] = joined.text
                    runs[name].append((wall, steps))
                # Both fan-outs wrote the same text (greedy, same program).
                assert texts["hooks"] == texts["client_join"]
            ideal = (a + k * m + n) / (a + m + 1 + n)
            row = {"k": k, "m": m, "ideal_speedup": round(ideal, 2)}
            for name, samples in runs.items():
                row[f"{name}_s"] = round(
                    statistics.median(w for w, _ in samples), 4)
                row[f"{name}_steps"] = samples[-1][1]
            row["speedup"] = round(row["sequential_s"] / row["hooks_s"], 2)
            row["speedup_vs_join"] = round(
                row["client_join_s"] / row["hooks_s"], 2)
            row["measured_over_ideal"] = round(row["speedup"] / ideal, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    report(rows, args.out,
           ("k", "m", "hooks_s", "sequential_s", "client_join_s",
            "hooks_steps", "sequential_steps", "client_join_steps", "speedup",
            "ideal_speedup", "measured_over_ideal", "speedup_vs_join"))


if __name__ == "__main__":
    main()
