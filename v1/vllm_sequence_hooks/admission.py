# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Requests a hooked V1 engine cannot serve, refused where they come in.

The scheduler runs in the engine core, past the point where a request can
be refused with a reason: a request it cannot serve would hang or end as
a 500. V1's one per-request check in the frontend that a plugin may add is
a custom logits processor's `validate_params`, run on every request's
sampling parameters before it reaches the engine (a `ValueError` there is
a 400 on the server, vLLM's `VLLMValidationError` offline). The logits
processor itself does nothing to the logits.

`HookedRequestCheck` is named with `--logits-processors` next to
`--scheduler-cls` (`hooked_engine_args` adds it for `LLM`); the scheduler
refuses to start without it. Its constructor, run by each worker before
the model loads, also checks the hooks' configuration, so a bad one stops
the engine before the model is loaded.
"""

import torch
from vllm_sequence_hooks.config import (REQUEST_CHECK, SCHEDULER_CLS,
                                        names_scheduler, special_kwargs_of)
from vllm_sequence_hooks.config_check import CheckOnlyLogitsProcessor

from vllm.config import VllmConfig
from vllm.sampling_params import SamplingParams

STRUCTURED_OUTPUTS = (
    "structured outputs (response_format json_object/json_schema/"
    "structural_tag, structured_outputs, or a tool_choice that forces a tool "
    "call) cannot be used with sequence hooks (this server runs with "
    "special_kwargs): the grammar forbids the <promise> and <sync> tokens, "
    "and the children's text merged into a parent is never checked against "
    "it.")


class HookedRequestCheck(CheckOnlyLogitsProcessor):
    """Refuses requests sequence hooks cannot serve; leaves logits alone.

    Args:
        vllm_config: The engine's configuration: the hooks' must be valid
            and name the plugin's scheduler.
        device: Unused (nothing runs on the device).
        is_pin_memory: Unused.

    Raises:
        ValueError: if `special_kwargs` is missing or invalid, or
            `--scheduler-cls` does not name the plugin's scheduler.
    """

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raises ValueError (a 400) for a request hooks cannot serve."""
        if sampling_params.structured_outputs is not None:
            raise ValueError(STRUCTURED_OUTPUTS)

    def __init__(self, vllm_config: VllmConfig, device: torch.device,
                 is_pin_memory: bool) -> None:
        if not names_scheduler(vllm_config):
            raise ValueError(
                f"{REQUEST_CHECK} is the request check of sequence hooks: "
                f"it needs --scheduler-cls {SCHEDULER_CLS} (got "
                f"{vllm_config.scheduler_config.scheduler_cls!r})")
        special_kwargs_of(vllm_config)
