# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Runs the conformance programs on one hooked V1 engine of its own
process and reports as JSON (the V1 twin of `run_programs`).

For configurations that need a process of their own, such as tensor
parallelism on V1's multiproc executor, the tests run this module in a
subprocess: each named program against the hook-free reference on the
same engine (`conformance.check_program`), then the engine core must be
clean. Prints one line `REPORT {...}`: per program "ok" or the failure,
and under "_engine" the parallel configuration and whether it was clean.

Usage: python -m sequence_hooks_testkit.v1_run_programs MODEL_DIR
    [--tensor-parallel-size 2]
"""

import argparse
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args()
    # The engine core in this process (the scheduler is inspected); the
    # workers are the multiproc executor's processes.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from sequence_hooks_testkit import conformance
    from sequence_hooks_testkit.tiny_model import tiny_hook_ids
    from sequence_hooks_testkit.v1_engines import (V1, assert_engine_clean,
                                                   v1_llm)

    ids = tiny_hook_ids()
    # Each CPU worker binds its threads: one core each when the machine
    # has one NUMA node (upstream refuses to pick for several workers).
    if args.tensor_parallel_size > 1:
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND",
            "|".join(str(core) for core in range(args.tensor_parallel_size)))
    llm = v1_llm(
        args.model,
        ids,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend="mp",
        # Each worker checks that this share of the machine's
        # memory is free (0.92 by default).
        gpu_memory_utilization=0.05)
    report = {}
    for name in conformance.PROGRAM_NAMES:
        try:
            conformance.check_program(V1, llm, llm, ids, name)
            report[name] = "ok"
        except AssertionError as failure:
            report[name] = f"failed: {failure}"[:2000]
    try:
        assert_engine_clean(llm)
        clean = "yes"
    except AssertionError as failure:
        clean = f"no: {failure}"[:2000]
    parallel = llm.llm_engine.vllm_config.parallel_config
    report["_engine"] = {
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "executor": str(parallel.distributed_executor_backend),
        "clean": clean,
    }
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
