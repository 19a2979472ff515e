# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tensor parallelism (TP = 2) on V1's multiproc executor: every
conformance program matches the hook-free reference and the engine core
is left clean. In a subprocess: torch.distributed is set up once a
process (`sequence_hooks_testkit.v1_run_programs`)."""

from sequence_hooks_testkit.v1_run_programs import assert_programs_match


def test_programs_match_the_reference_with_two_tensor_parallel_workers(
        tiny_model_path):
    assert_programs_match(tiny_model_path,
                          "--tensor-parallel-size",
                          "2",
                          timeout_s=900,
                          tensor_parallel_size=2,
                          pipeline_parallel_size=1,
                          batches_in_flight=1)
