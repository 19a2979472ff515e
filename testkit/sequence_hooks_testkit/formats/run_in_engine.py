# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Runs a format in-engine (the V1 plugin, offline `LLM` with
``special_kwargs={"format": ...}``) in a process of its own and writes
each answer as JSON: its token ids, text, finish reason and tree.

Usage (in .venv-v1): python -m sequence_hooks_testkit.formats.run_in_engine
    MODEL FORMAT CASES.json OUT.json [--format-options JSON]

CASES.json is a list of cases, each ``{"name", "prompts": [text],
"max_tokens": N or null}``, greedy unless ``"sampling"`` gives
`SamplingParams` fields (``n`` among them: every sample is an answer, in
order, each with its tree; ``logprobs`` puts the sampled tokens'
logprobs in the tree); fp32, eager, the same engine settings as
`run_threadweaver`'s stock side. The prompts are tokenized without
special tokens, or with ``"text": true`` sent as text (tokenized as the
completions API does: APR's controller sends text).
``--format-options`` gives the format's ``format_options``;
``--block-size`` the KV cache's block size (this CPU's default: 128).

Each answer also carries ``scheduled``: per request of its tree (by
request id; the root's is the answer's), the tokens the engine's
scheduler gave it to compute in each step it ran, in order (what the
engine computed, read from each step's `SchedulerOutput`).
"""

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path


def record_scheduled(llm) -> dict[str, list[int]]:
    """Wraps the in-process engine's scheduler so that each step's tokens
    per request are recorded.

    Returns:
        The record: per request id, its tokens computed per step.
    """
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    scheduled: dict[str, list[int]] = defaultdict(list)
    schedule = scheduler.schedule

    def recorded(*args, **kwargs):
        output = schedule(*args, **kwargs)
        for request_id, count in output.num_scheduled_tokens.items():
            scheduled[request_id].append(count)
        return output

    scheduler.schedule = recorded
    return scheduled


def request_ids(output, tree) -> list[str]:
    """The answer's request ids: its tree's nodes' (``tree`` is its
    root), or the output's."""
    if tree is None:
        return [output.request_id]
    nodes, ids = [tree], []
    while nodes:
        node = nodes.pop()
        ids.append(node.request_id)
        nodes += node.children
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("format")
    parser.add_argument("cases", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--format-options", type=json.loads)
    parser.add_argument("--block-size", type=int)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm_sequence_hooks
    from vllm_sequence_hooks.outputs import promise_tree

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    assert vllm_sequence_hooks
    llm = LLM(model=args.model,
              max_model_len=args.max_model_len,
              enforce_eager=True,
              dtype="float32",
              seed=0,
              block_size=args.block_size,
              special_kwargs={
                  "format": args.format,
                  "format_options": args.format_options
              })
    tokenizer = llm.get_tokenizer()
    scheduled = record_scheduled(llm)
    results = []
    for case in json.loads(args.cases.read_text()):
        prompts = case["prompts"] if case.get("text") else [
            TokensPrompt(prompt_token_ids=tokenizer.encode(
                text, add_special_tokens=False)) for text in case["prompts"]
        ]
        sampling = {"temperature": 0.0, **case.get("sampling", {})}
        outputs = llm.generate(prompts,
                               SamplingParams(max_tokens=case["max_tokens"],
                                              **sampling),
                               use_tqdm=False)
        answers = []
        for output in outputs:
            for completion in output.outputs:
                tree = promise_tree(output, completion)
                answers.append(
                    dict(token_ids=list(completion.token_ids),
                         text=completion.text,
                         finish_reason=completion.finish_reason,
                         tree=None if tree is None else tree.to_dict(),
                         scheduled={
                             request_id: scheduled[request_id]
                             for request_id in request_ids(output, tree)
                         }))
        results.append({"name": case["name"], "answers": answers})
    args.out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
