# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Runs the end-to-end programs on one hooked engine and reports as JSON.

For configurations that need a process of their own, such as tensor
parallelism (torch.distributed is set up once a process), the tests run
this script in a subprocess. The reference is built on the same engine:
hooks act only on sampled tokens and each reference segment ends on its
`<sync>`, so the plain generation it needs runs unchanged there.

Usage: python -m sequence_hooks_testkit.run_programs MODEL_DIR
    --tensor-parallel-size 2 [--distributed-executor-backend mp]
"""

import argparse
import json
import os

from sequence_hooks_testkit.engines import tiny_llm
from sequence_hooks_testkit.oracle import reference, scripted
from sequence_hooks_testkit.programs import programs
from sequence_hooks_testkit.tiny_model import tiny_hook_ids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--distributed-executor-backend", default="mp")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_USE_V1", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import SamplingParams

    ids = tiny_hook_ids()
    llm = tiny_llm(
        args.model,
        ids,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend)
    engine = llm.llm_engine
    named = programs(ids)
    outputs = llm.generate(["the cat sees"] * len(named), [
        SamplingParams(temperature=0.0,
                       max_tokens=64,
                       logits_processors=[scripted(plans, ids)])
        for plans in named.values()
    ],
                           use_tqdm=False)
    report = {}
    for (name, plans), output in zip(named.items(), outputs):
        expected = reference(llm, ids, plans, output.prompt_token_ids)
        tree = output.promise_tree
        report[name] = {
            "tokens_match":
            list(output.outputs[0].token_ids) == expected.token_ids,
            "children": 0 if tree is None else len(tree.children),
            "expected_children": len(expected.children),
        }
    block_manager = engine.scheduler[0].block_manager
    report["_engine"] = {
        "free_blocks": block_manager.get_num_free_gpu_blocks(),
        "total_blocks": block_manager.num_total_gpu_blocks,
        "unfinished": engine.has_unfinished_requests(),
        "tensor_parallel_size": engine.parallel_config.tensor_parallel_size,
    }
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
