# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tensor parallelism (TP = 2) on V1's multiproc executor: every
conformance program matches the hook-free reference and the engine core
is left clean. In a subprocess: torch.distributed is set up once a
process (`sequence_hooks_testkit.v1_run_programs`)."""

import json
import subprocess
import sys

from sequence_hooks_testkit.conformance import PROGRAM_NAMES


def test_programs_match_the_reference_with_two_tensor_parallel_workers(
        tiny_model_path):
    result = subprocess.run([
        sys.executable, "-m", "sequence_hooks_testkit.v1_run_programs",
        str(tiny_model_path), "--tensor-parallel-size", "2"
    ],
                            capture_output=True,
                            text=True,
                            timeout=900)
    lines = [
        line for line in result.stdout.splitlines()
        if line.startswith("REPORT ")
    ]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    report = json.loads(lines[-1][len("REPORT "):])
    engine = report.pop("_engine")
    assert engine == {
        "tensor_parallel_size": 2,
        "executor": "mp",
        "clean": "yes"
    }
    assert report == dict.fromkeys(PROGRAM_NAMES, "ok")
