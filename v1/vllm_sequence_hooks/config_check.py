# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hooks configured without the plugin's scheduler, refused at start.

`--additional-config '{"special_kwargs": ...}'` alone turns nothing on:
the stock scheduler ignores it, and the server would run without hooks,
without a word. No plugin code runs there unless vLLM loads it by
itself: `HooksConfigCheck` is registered under vLLM's entry-point group
for logits processors (`vllm.logits_processors`, v1/pyproject.toml), so
every V1 engine in an environment with the plugin installed builds it in
each worker, before the model loads. It refuses `special_kwargs` without
`--scheduler-cls` naming the plugin's scheduler, and otherwise does
nothing (it leaves logits alone and is skipped for greedy batches).
"""

from typing import Optional

import torch
from vllm_sequence_hooks.config import (CONFIG_KEY, REQUEST_CHECK,
                                        SCHEDULER_CLS, names_scheduler)

from vllm.config import VllmConfig
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor


class CheckOnlyLogitsProcessor(LogitsProcessor):
    """A logits processor used only for its checks (its constructor and
    `validate_params`): it leaves logits alone, and greedy batches skip
    it."""

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


class HooksConfigCheck(CheckOnlyLogitsProcessor):
    """Refuses `special_kwargs` without the hooks' scheduler.

    Args:
        vllm_config: The engine's configuration.
        device: Unused.
        is_pin_memory: Unused.

    Raises:
        ValueError: if `additional_config` has `special_kwargs` and
            `--scheduler-cls` does not name the plugin's scheduler.
    """

    def __init__(self, vllm_config: VllmConfig, device: torch.device,
                 is_pin_memory: bool) -> None:
        if (CONFIG_KEY in (vllm_config.additional_config or {})
                and not names_scheduler(vllm_config)):
            raise ValueError(
                f"additional_config has {CONFIG_KEY!r} but --scheduler-cls "
                f"is not {SCHEDULER_CLS}: the hooks would be off. Add "
                f"--scheduler-cls {SCHEDULER_CLS} --logits-processors "
                f"{REQUEST_CHECK}, or drop {CONFIG_KEY}")
