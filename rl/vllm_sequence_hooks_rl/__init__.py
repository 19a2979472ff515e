# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GRPO on promise trees with TRL (docs/rl.md): `PromiseTreeGRPOTrainer`
trains every node of the trees the hooked engine samples; `tree_rollout`
is the same rollout as a plain TRL `rollout_func`.

Its own distribution (`vllm-sequence-hooks-rl`): serving never imports
it, and the plugin's wheel carries no TRL-facing code.
"""

from vllm_sequence_hooks_rl.rollout import (CHILDREN_KEY, TREE_KEY,
                                            hooked_trl_engine, run_trees,
                                            tree_rollout)
from vllm_sequence_hooks_rl.settings import (AUXILIARY_WEIGHT_RATIO,
                                             SMALL_REWARD_SPREAD,
                                             TOKEN_NORMALIZED_LOSSES,
                                             small_spread_groups)
from vllm_sequence_hooks_rl.trainer import PromiseTreeGRPOTrainer
from vllm_sequence_hooks_rl.trl_seams import SUPPORTED_TRL_VERSIONS, TRL_SEAMS

__all__ = [
    "AUXILIARY_WEIGHT_RATIO", "CHILDREN_KEY", "SMALL_REWARD_SPREAD",
    "SUPPORTED_TRL_VERSIONS", "TOKEN_NORMALIZED_LOSSES", "TREE_KEY",
    "TRL_SEAMS", "PromiseTreeGRPOTrainer", "hooked_trl_engine", "run_trees",
    "small_spread_groups", "tree_rollout"
]
