# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Scripted and random promise/sync programs as V1 logits processors.

V1 has no per-request callables: a batch-level processor class is given to
the engine (`LLM(logits_processors=[ScriptedHooksV1])`) and each request
carries its script in `SamplingParams.extra_args["scripted_hooks"]`. A
script holds the plans per role path (as `scripted_hooks.py`
defines them) and a nonce naming the request. Progress is kept in the
processor per (nonce, seed, role path told by the context): a child (a
clone of its parent's params) has its own role path, the samples of an
`n > 1` request their own seeds, and a parked parent's params may come
back to the model runner as a fresh copy when it resumes.
"""

import functools
import itertools
import json
import os
import random
import time
from typing import Any, Optional

import torch

from sequence_hooks_testkit.conformance import pick_token
from vllm.v1.sample.logits_processor import (BatchUpdate, LogitsProcessor,
                                             MoveDirectionality)

# Key of `SamplingParams.extra_args` that holds a request's script.
SCRIPT_KEY = "scripted_hooks"
# Key of `SamplingParams.extra_args` that holds a random policy (the fuzz).
POLICY_KEY = "random_hooks"
# Environment variable: seconds `StepDelayV1` adds to each engine step.
STEP_DELAY_ENV = "SEQHOOK_TEST_STEP_DELAY_S"
# Key of `SamplingParams.extra_args`: seconds `StepDelayV1` adds to each
# engine step that runs the request (a server shared with tests that need
# no delay).
STEP_DELAY_KEY = "step_delay_s"
# Names each script's request (progress is kept per request and role).
_nonces = itertools.count()


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
        "step": step,
        "nonce": f"{random.getrandbits(64):x}-{next(_nonces)}",
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


class RowsByExtraArg(LogitsProcessor):
    """Tracks the batch rows whose request carries ``extra_args[KEY]``."""

    # The `SamplingParams.extra_args` key this processor acts on.
    KEY = ""

    def __init__(self, vllm_config, device: torch.device,
                 is_pin_memory: bool) -> None:
        # Batch row -> (its extra arg, prompt ids, live output ids).
        self.rows: dict[int, tuple[Any, list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        # V1 skips argmax-invariant processors for greedy batches.
        return False

    def row_value(self, value: Any, params) -> Any:
        """What a row keeps of its request's extra arg (not None): a dict,
        which the OpenAI server's `vllm_xargs` bring as JSON (their values
        are scalars)."""
        if isinstance(value, str):
            value = json.loads(value)
        # The seed tells apart the samples of an `n > 1` request, which
        # share their params' extra args.
        return dict(value, seed_of_row=params.seed)

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, prompt_ids, output_ids in batch_update.added:
            value = (params.extra_args or {}).get(self.KEY)
            if value is None:
                self.rows.pop(index, None)
            else:
                value = self.row_value(value, params)
                self.rows[index] = (value, prompt_ids or [], output_ids)
        for first, second, direction in batch_update.moved:
            moving = self.rows.pop(first, None)
            other = self.rows.pop(second, None)
            if direction == MoveDirectionality.SWAP and other is not None:
                self.rows[first] = other
            if moving is not None:
                self.rows[second] = moving


class ScriptedHooksV1(RowsByExtraArg):
    """Forces each scripted request's token by its role path's plan."""

    KEY = SCRIPT_KEY

    def __init__(self, vllm_config, device: torch.device,
                 is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        # (nonce, seed, role path) -> the next plan step.
        self.progress: dict[tuple[str, Optional[int], tuple[int, ...]],
                            int] = {}

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (script, prompt_ids, output_ids) in self.rows.items():
            # Keyed by the role the context tells even for a fixed-role
            # script: a child spawned on a hooked engine during a reference
            # segment then does not advance the segment's progress.
            told = role_of(script, prompt_ids + output_ids)
            role = told if script["fixed_role"] is None else script[
                "fixed_role"]
            key = (script["nonce"], script["seed_of_row"], tuple(told))
            step = self.progress.get(key, script["step"])
            self.progress[key] = step + 1
            plan = next((p for path, p in script["plans"] if path == role), [])
            forced = plan[step] if step < len(plan) else script["eos"]
            if forced is None:
                logits[index, script["masked"]] = -float("inf")
            else:
                logits[index].fill_(-float("inf"))
                logits[index, forced] = 0.0
        return logits


class RandomHooksV1(RowsByExtraArg):
    """Forces a token drawn from a hash of the request's whole context.

    For the fuzz: `extra_args[POLICY_KEY]` holds a seed, the words to draw
    from and `[token id, probability]` pairs for the hook tokens and EOS.
    Stateless, so a child (same policy, another context) draws its own
    tokens and a resumed parent needs nothing restored.
    """

    KEY = POLICY_KEY

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (policy, prompt_ids, output_ids) in self.rows.items():
            rng = random.Random(
                hash((policy["seed"], *prompt_ids, *output_ids)))
            token_id = pick_token(
                rng.random(), policy["hooks"],
                functools.partial(rng.choice, policy["words"]))
            logits[index].fill_(-float("inf"))
            logits[index, token_id] = 0.0
        return logits


class StepDelayV1(RowsByExtraArg):
    """Makes each engine step with requests last ``STEP_DELAY_ENV``
    seconds longer (a slow model), and each step with a request whose
    ``extra_args[STEP_DELAY_KEY]`` asks for more that much longer, so
    streams are still running when a test acts on them. Leaves logits
    alone."""

    KEY = STEP_DELAY_KEY

    def __init__(self, vllm_config, device: torch.device,
                 is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        self.delay = float(os.environ.get(STEP_DELAY_ENV, "0"))

    def row_value(self, value: Any, params) -> float:
        return float(value)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.shape[0]:
            delay = max([self.delay, *(row[0] for row in self.rows.values())])
            if delay:
                time.sleep(delay)
        return logits
