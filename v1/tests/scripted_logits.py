# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scripted promise/sync programs as a V1 logits processor.

V1 has no per-request callables: a batch-level processor class is given to
the engine (`LLM(logits_processors=[ScriptedHooksV1])`) and each request
carries its script in `SamplingParams.extra_args["scripted_hooks"]`. A
script holds the plans per role path (as `mytests/scripted_hooks.py`
defines them) and its progress (role, step), kept in that same dict: the
hook scheduler clones a parent's params for its children (so a child
starts from a copy), and a parked parent keeps its params object across
its removal from and return to the model runner's batch.
"""

from typing import Any, Optional

import torch

from vllm.v1.sample.logits_processor import (BatchUpdate, LogitsProcessor,
                                             MoveDirectionality)

# Key of `SamplingParams.extra_args` that holds a request's script.
SCRIPT_KEY = "scripted_hooks"


def make_script(plans: dict,
                ids,
                masked_ids,
                role: Optional[tuple] = None,
                step: int = 0) -> dict[str, Any]:
    """A script for `SamplingParams.extra_args[SCRIPT_KEY]`.

    Args:
        plans: Tokens per role path (None: the model's choice).
        ids: The hook token ids (`sync`, `promise`, `child`, `eos`).
        masked_ids: Ids never chosen on a free step.
        role: Fixed role path for a plain engine (the reference), which
            sees the context as prompt and so cannot tell roles apart by
            role markers it did not add itself.
        step: The plan step a fixed-role script starts at.
    """
    return {
        "plans": [[list(path), plan] for path, plan in plans.items()],
        "promise": ids.promise,
        "child": ids.child,
        "eos": ids.eos,
        "masked": list(masked_ids),
        "fixed_role": None if role is None else list(role),
        "role": None if role is None else list(role),
        "step": step,
    }


def role_of(script: dict, token_ids: list[int]) -> list[int]:
    """The role path told by a context's promises and role markers."""
    role: list[int] = []
    promises = 0
    for token_id in token_ids:
        if token_id == script["promise"]:
            promises += 1
        elif token_id == script["child"]:
            role, promises = role + [promises - 1], 0
    return role


class ScriptedHooksV1(LogitsProcessor):
    """Forces each scripted request's token by its role path's plan."""

    def __init__(self, vllm_config, device: torch.device,
                 is_pin_memory: bool) -> None:
        # Batch row -> (script, prompt token ids, live output token ids).
        self.rows: dict[int, tuple[dict, list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, prompt_ids, output_ids in batch_update.added:
            script = (params.extra_args or {}).get(SCRIPT_KEY)
            if script is None:
                self.rows.pop(index, None)
            else:
                self.rows[index] = (script, prompt_ids or [], output_ids)
        for first, second, direction in batch_update.moved:
            moving = self.rows.pop(first, None)
            other = self.rows.pop(second, None)
            if direction == MoveDirectionality.SWAP and other is not None:
                self.rows[first] = other
            if moving is not None:
                self.rows[second] = moving

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (script, prompt_ids, output_ids) in self.rows.items():
            if script["fixed_role"] is None:
                role = role_of(script, prompt_ids + output_ids)
                if role != script["role"]:
                    # A child's first step: it still had its parent's.
                    script["role"], script["step"] = role, 0
            plan = next((p for path, p in script["plans"]
                         if path == script["role"]), [])
            step = script["step"]
            forced = plan[step] if step < len(plan) else script["eos"]
            script["step"] += 1
            if forced is None:
                logits[index, script["masked"]] = -float("inf")
            else:
                logits[index].fill_(-float("inf"))
                logits[index, forced] = 0.0
        return logits
