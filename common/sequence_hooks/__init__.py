# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sequence hooks: `<promise>` spawns a child sequence, `<sync>` joins them.

The engine-neutral part, shared by the V0 fork and the V1 plugin: the
configuration users give (`SpecialKwargs`) and the tree they get back
(`PromiseNode`), flattened for training (`training_records`). It imports
no vLLM module.
"""

from sequence_hooks.special_kwargs import SpecialKwargs
from sequence_hooks.training_records import SequenceRecord, training_records
from sequence_hooks.tree import PromiseNode

__all__ = [
    "PromiseNode", "SequenceRecord", "SpecialKwargs", "training_records"
]
