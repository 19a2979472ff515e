# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How the V1 plugin is configured: `--scheduler-cls`, the
`special_kwargs` key of `--additional-config` and the request check of
`--logits-processors` (`admission`), and the checks of that configuration
that the scheduler and the request check share."""

from typing import Any, Optional

from vllm_sequence_hooks.seams import check_vllm_version

from sequence_hooks import SpecialKwargs
from vllm.config import VllmConfig
from vllm.tokenizers import cached_tokenizer_from_config

# Key of `additional_config` that holds the SpecialKwargs (dict or JSON).
CONFIG_KEY = "special_kwargs"
# What `--scheduler-cls` names.
SCHEDULER_CLS = "vllm_sequence_hooks.scheduler.SequenceHookScheduler"
# What `--logits-processors` names (`admission.HookedRequestCheck`).
REQUEST_CHECK = "vllm_sequence_hooks.admission:HookedRequestCheck"


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
    return parse_special_kwargs(raw)


def parse_special_kwargs(raw: Any) -> SpecialKwargs:
    """A SpecialKwargs from itself, a dict of its fields or its JSON.

    Raises:
        ValueError: if it is invalid.
    """
    if isinstance(raw, SpecialKwargs):
        return raw
    if isinstance(raw, str):
        return SpecialKwargs.from_json(raw)
    return SpecialKwargs(**raw)


def check_special_kwargs(special_kwargs: SpecialKwargs,
                         vllm_config: VllmConfig,
                         tokenizer: Optional[Any] = None) -> SpecialKwargs:
    """Resolves token strings to ids and checks them against the model.

    Args:
        special_kwargs: The hooks' configuration.
        vllm_config: The engine's configuration (its model's).
        tokenizer: The model's tokenizer; loaded if None.

    Returns:
        ``special_kwargs`` with every token given by id.

    Raises:
        ValueError: if a token is not one of the model's, is outside its
            vocabulary or is its end-of-sequence token.
    """
    model_config = vllm_config.model_config
    if tokenizer is None:
        tokenizer = cached_tokenizer_from_config(model_config)
    resolved = special_kwargs.resolve(tokenizer)
    resolved.check_vocab_size(model_config.get_vocab_size())
    resolved.check_not_eos(model_config.hf_config.eos_token_id)
    return resolved


def names_scheduler(vllm_config: VllmConfig) -> bool:
    """Whether `--scheduler-cls` names the plugin's scheduler."""
    scheduler_cls = vllm_config.scheduler_config.scheduler_cls
    if not isinstance(scheduler_cls, str):
        scheduler_cls = (getattr(scheduler_cls, "__module__", "") + "." +
                         getattr(scheduler_cls, "__qualname__", ""))
    return scheduler_cls == SCHEDULER_CLS


def hooked_engine_args(special_kwargs: Any) -> dict[str, Any]:
    """Engine arguments that turn the hooks on, for `LLM(**...)`.

    Args:
        special_kwargs: A SpecialKwargs, a dict of its fields or its JSON.

    Returns:
        `scheduler_cls`, `additional_config` and `logits_processors` (the
        request check) for `LLM` / `EngineArgs`; a caller with logits
        processors of its own adds them to the list.

    Raises:
        UnsupportedVllmVersion: on a vLLM the plugin was not tested on
            (before any model is loaded).
        ValueError: if ``special_kwargs`` is invalid.
    """
    check_vllm_version()
    parsed = parse_special_kwargs(special_kwargs)
    if isinstance(special_kwargs, SpecialKwargs):
        special_kwargs = {
            name: getattr(parsed, name)
            for name in SpecialKwargs.__dataclass_fields__
        }
    return {
        "scheduler_cls": SCHEDULER_CLS,
        "additional_config": {
            CONFIG_KEY: special_kwargs
        },
        "logits_processors": [REQUEST_CHECK],
    }
