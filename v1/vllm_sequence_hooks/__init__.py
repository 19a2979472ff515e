# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Promise/sync sequence hooks for the V1 engine of stock vLLM."""

from vllm_sequence_hooks.config import hooked_engine_args
from vllm_sequence_hooks.outputs import promise_tree
from vllm_sequence_hooks.scheduler import SequenceHookScheduler
from vllm_sequence_hooks.transport import TREE_KEY

__all__ = [
    "SequenceHookScheduler", "TREE_KEY", "hooked_engine_args", "promise_tree"
]
