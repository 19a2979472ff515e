# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sequence hooks: `<promise>` spawns a child sequence, `<sync>` joins them.

The engine-neutral part, shared by the V0 fork, the V1 plugin and the
client-side join: the configuration users give (`SpecialKwargs`), the
lifecycle every engine runs (`lifecycle.Coordinator`, which
answers each event with `actions` for the engine to carry out), what
schedulers put first (`ordering`: both hand it their queues), the tree
users get back (`PromiseNode`), flattened for training
(`training_records`). It imports no vLLM module.
"""

from sequence_hooks.actions import child_request_id
from sequence_hooks.formats import Format, register_format
from sequence_hooks.lifecycle import Coordinator, FormatPolicy
from sequence_hooks.special_kwargs import SpecialKwargs
from sequence_hooks.training_records import SequenceRecord, training_records
from sequence_hooks.tree import PromiseNode

__all__ = [
    "Coordinator", "Format", "FormatPolicy", "PromiseNode", "SequenceRecord",
    "SpecialKwargs", "child_request_id", "register_format", "training_records"
]
