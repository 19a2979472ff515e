# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How the V1 plugin is configured: `--scheduler-cls` and the
`special_kwargs` key of `--additional-config`."""

from typing import Any

from vllm_sequence_hooks.seams import check_vllm_version

from sequence_hooks import SpecialKwargs
from vllm.config import VllmConfig

# Key of `additional_config` that holds the SpecialKwargs (dict or JSON).
CONFIG_KEY = "special_kwargs"
# What `--scheduler-cls` names.
SCHEDULER_CLS = "vllm_sequence_hooks.scheduler.SequenceHookScheduler"


def special_kwargs_of(vllm_config: VllmConfig) -> SpecialKwargs:
    """Reads and validates the hooks' configuration.

    Args:
        vllm_config: The engine's configuration.

    Returns:
        The SpecialKwargs in `additional_config["special_kwargs"]`.

    Raises:
        ValueError: if it is missing or invalid.
    """
    raw = (vllm_config.additional_config or {}).get(CONFIG_KEY)
    if raw is None:
        raise ValueError(f"SequenceHookScheduler needs additional_config="
                         f"{{'{CONFIG_KEY}': {{...}}}}")
    if isinstance(raw, SpecialKwargs):
        return raw
    if isinstance(raw, str):
        return SpecialKwargs.from_json(raw)
    return SpecialKwargs(**raw)


def hooked_engine_args(special_kwargs: Any) -> dict[str, Any]:
    """Engine arguments that turn the hooks on, for `LLM(**...)`.

    Args:
        special_kwargs: A SpecialKwargs, a dict of its fields or its JSON.

    Returns:
        `scheduler_cls` and `additional_config` for `LLM` / `EngineArgs`.

    Raises:
        UnsupportedVllmVersion: on a vLLM the plugin was not tested on
            (before any model is loaded).
        ValueError: if ``special_kwargs`` is invalid.
    """
    check_vllm_version()
    if isinstance(special_kwargs, SpecialKwargs):
        special_kwargs = {
            name: getattr(special_kwargs, name)
            for name in SpecialKwargs.__dataclass_fields__
        }
    elif isinstance(special_kwargs, str):
        SpecialKwargs.from_json(special_kwargs)
    else:
        SpecialKwargs(**special_kwargs)
    return {
        "scheduler_cls": SCHEDULER_CLS,
        "additional_config": {
            CONFIG_KEY: special_kwargs
        },
    }
