# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Runs the conformance programs on one hooked V1 engine of its own
process and reports as JSON (the V1 twin of `run_programs`).

For configurations that need a process of their own, tensor and pipeline
parallelism on V1's multiproc executor, the tests run this module in a
subprocess (`report_of`; `assert_programs_match` checks its report):
each named program against the hook-free reference on the same engine
(`conformance.check_program`), then the engine core must be clean.
Prints one line `REPORT {...}`: per program "ok" or the failure, and
under "_engine" the parallel configuration, the batches the engine core
keeps in flight and whether it was left clean.

With pipeline parallelism the model is compiled (not eager): on the CPU,
vLLM 0.32's model runner allocates the buffers a later pipeline stage
receives its inputs in (`intermediate_tensors`) only in its dummy run,
which the CPU runs as the compilation's warm-up; eager, the second
stage's first step fails (`assert self.intermediate_tensors is not
None`), with or without hooks.

Usage: python -m sequence_hooks_testkit.v1_run_programs MODEL_DIR
    [--tensor-parallel-size 2] [--pipeline-parallel-size 2]
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPORT = "REPORT "


def report_of(model_path: Path, *args: str,
              timeout_s: float) -> tuple[dict, dict]:
    """Runs this module on ``model_path`` in a subprocess.

    Args:
        model_path: The tiny model's folder.
        args: This module's options (`--tensor-parallel-size 2`).
        timeout_s: How long the run may take.

    Returns:
        The engine's facts ("_engine") and each program's outcome.
    """
    result = subprocess.run([
        sys.executable, "-m", "sequence_hooks_testkit.v1_run_programs",
        str(model_path), *args
    ],
                            capture_output=True,
                            text=True,
                            timeout=timeout_s)
    lines = [
        line for line in result.stdout.splitlines() if line.startswith(REPORT)
    ]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    report = json.loads(lines[-1][len(REPORT):])
    return report.pop("_engine"), report


def assert_programs_match(model_path: Path, *args: str, timeout_s: float,
                          **engine) -> None:
    """Asserts that every conformance program run by this module (options
    ``args``, `report_of`) matched the hook-free reference, on the engine
    ``engine`` describes (parallel sizes, batches in flight), with the
    multiproc executor, and that the engine core was left clean."""
    from sequence_hooks_testkit.conformance import PROGRAM_NAMES
    found, report = report_of(model_path, *args, timeout_s=timeout_s)
    assert found == {**engine, "executor": "mp", "clean": "yes"}
    assert report == dict.fromkeys(PROGRAM_NAMES, "ok")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    args = parser.parse_args()
    # The engine core in this process (the scheduler is inspected); the
    # workers are the multiproc executor's processes.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    workers = args.tensor_parallel_size * args.pipeline_parallel_size
    # Each CPU worker binds its threads: one core each when the machine
    # has one NUMA node (upstream refuses to pick for several workers).
    if workers > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                              "|".join(str(core) for core in range(workers)))
    from sequence_hooks_testkit import conformance
    from sequence_hooks_testkit.tiny_model import tiny_hook_ids
    from sequence_hooks_testkit.v1_engines import (V1, assert_engine_clean,
                                                   v1_llm)

    ids = tiny_hook_ids()
    llm = v1_llm(
        args.model,
        ids,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        distributed_executor_backend="mp",
        enforce_eager=args.pipeline_parallel_size == 1,
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
    config = llm.llm_engine.vllm_config
    report["_engine"] = {
        "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
        "pipeline_parallel_size":
        config.parallel_config.pipeline_parallel_size,
        "executor": str(config.parallel_config.distributed_executor_backend),
        "batches_in_flight": config.max_concurrent_batches,
        "clean": clean,
    }
    print(REPORT + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
