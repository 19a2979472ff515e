# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sequence hooks under tensor parallelism: two CPU worker processes.

The hooks live in the engine process; workers see only scheduled metadata
(forked block tables, copy-on-write copies, resumed prefills). The programs
run in a subprocess, since a process sets up torch.distributed only once.
"""

import json
import os
import subprocess
import sys

import pytest

from sequence_hooks_testkit.engines import engine_config


def test_programs_match_the_reference_with_tp2_mp(tiny_model_path):
    result = subprocess.run(
        [
            sys.executable, "-m", "sequence_hooks_testkit.run_programs",
            str(tiny_model_path), "--tensor-parallel-size", "2",
            "--distributed-executor-backend", "mp"
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, VLLM_USE_V1="0"),
    )
    lines = [
        line for line in result.stdout.splitlines()
        if line.startswith("REPORT ")
    ]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    report = json.loads(lines[-1][len("REPORT "):])
    engine = report.pop("_engine")
    assert engine["tensor_parallel_size"] == 2
    assert engine["free_blocks"] == engine["total_blocks"]
    assert not engine["unfinished"]
    assert len(report) >= 7
    for name, case in report.items():
        assert case["tokens_match"], name
        assert case["children"] == case["expected_children"], name


def test_ray_backend_falls_back_to_mp_on_the_cpu(tiny_model_path, hooks):
    config = engine_config(tiny_model_path,
                           tensor_parallel_size=2,
                           distributed_executor_backend="ray",
                           special_kwargs=hooks)
    # Upstream's CpuPlatform: "ray is not supported on CPU".
    assert config.parallel_config.distributed_executor_backend == "mp"


def test_ray_spmd_delta_mode_is_refused(tiny_model_path, hooks, monkeypatch):
    monkeypatch.setenv("VLLM_USE_RAY_SPMD_WORKER", "1")
    with pytest.raises(ValueError, match="Ray SPMD workers"):
        engine_config(tiny_model_path,
                      distributed_executor_backend="ray",
                      special_kwargs=hooks)
