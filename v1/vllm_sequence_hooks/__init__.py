# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Promise/sync sequence hooks for the V1 engine of stock vLLM.

Importing the package registers `special_kwargs=` for `LLM` and
`EngineArgs` (`engine_args`), which vLLM itself does only once an engine
is being built: too late for `LLM(model, special_kwargs=...)`.
"""

from vllm_sequence_hooks.config import hooked_engine_args
from vllm_sequence_hooks.engine_args import register
from vllm_sequence_hooks.outputs import promise_tree
from vllm_sequence_hooks.scheduler import SequenceHookScheduler
from vllm_sequence_hooks.transport import TREE_KEY

register()

__all__ = [
    "SequenceHookScheduler", "TREE_KEY", "hooked_engine_args", "promise_tree",
    "register"
]
