# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""RL rollouts: n samples per prompt, every tree flattened into training
records (one per sequence), written as JSON lines.

Each record holds the context the sequence was generated from, the tokens
it produced, which of them it sampled (merged tokens were given by the
engine: no loss on them), their logprobs, and its parent's id: what a GRPO
style trainer needs. Works with any model that speaks promise/sync with
`<promise>`, `<sync>` and `<child>` tokens.

Usage:
    .venv/bin/python examples/rl_rollouts.py \\
        --model "$(.venv/bin/python -m \\
            sequence_hooks_training.prepare_base_model | tail -1)" \\
        --system "You are a helpful assistant. Answer each item in its own \\
parallel branch." \\
        --chat "What is the capital of each of these countries: Peru, Chile?" \\
        --n 4 --out rollouts.jsonl
    .venv/bin/python examples/rl_rollouts.py --model models/expand \\
        --prompt "cat dog sun red big then old new fish tree moon"
"""

import argparse
import dataclasses
import json
import os

# examples/demo.py, beside this script.
from demo import hooked_llm, requests_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model folder")
    parser.add_argument("--prompt",
                        action="append",
                        default=[],
                        help="a plain prompt (repeatable)")
    parser.add_argument("--chat",
                        action="append",
                        default=[],
                        help="a user message, chat-templated (repeatable)")
    parser.add_argument("--system", help="system message of the chat prompts")
    parser.add_argument("--n", type=int, default=4, help="samples a prompt")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--out", default="rollouts.jsonl")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_USE_V1", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from sequence_hooks import training_records
    from vllm import SamplingParams

    llm = hooked_llm(
        "v0", args.model,
        dict(sync_token="<sync>",
             promise_token="<promise>",
             child_role_token="<child>"))
    tokenizer = llm.get_tokenizer()
    # Token ids, not text: a chat-templated string would get a second BOS.
    prompts = [{
        "prompt_token_ids":
        tokenizer.encode(p, add_special_tokens=False)
    } for p in args.prompt]
    prompts += requests_of(llm, args.chat, args.system or "")
    params = SamplingParams(n=args.n,
                            temperature=args.temperature,
                            seed=args.seed,
                            logprobs=0,
                            max_tokens=args.max_tokens)
    marker = tokenizer.convert_tokens_to_ids("<child>")
    written = 0
    with open(args.out, "w") as out:
        for output in llm.generate(prompts, params):
            for sample in output.outputs:
                if sample.promise_tree is None:
                    continue
                for record in training_records(output.prompt_token_ids,
                                               sample.promise_tree, marker):
                    row = dataclasses.asdict(record)
                    row.update(prompt_index=int(output.request_id),
                               sample=sample.index)
                    out.write(json.dumps(row) + "\n")
                    written += 1
    print(f"wrote {written} records of {len(prompts) * args.n} samples "
          f"to {args.out}")


if __name__ == "__main__":
    main()
