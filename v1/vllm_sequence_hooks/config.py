# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How the V1 plugin is configured: `--scheduler-cls`, the
`special_kwargs` key of `--additional-config`, the request check of
`--logits-processors` (`admission`) and, on a server, three `--middleware`;
`hooked_settings` derives them all from `special_kwargs` (the one flag,
`engine_args`), and the checks of that configuration that the scheduler,
the request check and `engine_args` share (`special_kwargs_of`, once a
process; `refuse_unservable`)."""

from collections.abc import Mapping
from typing import Any

from vllm_sequence_hooks.seams import check_vllm_version

from sequence_hooks import SpecialKwargs
from sequence_hooks.formats import ENGINE_CAPABILITIES
from sequence_hooks.special_kwargs import (ModelTokens, checked_special_kwargs,
                                           fields_of)
from vllm.config import VllmConfig
from vllm.tokenizers import cached_tokenizer_from_config

# Key of `additional_config` that holds the SpecialKwargs (dict or JSON).
CONFIG_KEY = "special_kwargs"
# What `--scheduler-cls` names.
SCHEDULER_CLS = "vllm_sequence_hooks.scheduler.SequenceHookScheduler"
# What `--logits-processors` names (`admission.HookedRequestCheck`).
REQUEST_CHECK = "vllm_sequence_hooks.admission:HookedRequestCheck"
# Why hooks refuse `skip_tokenizer_init`, as V0 does.
SKIP_TOKENIZER_INIT = (
    "special_kwargs: sequence hooks cannot run with skip_tokenizer_init: "
    "they decode each child's text and encode it into its parent, and "
    "resolve token strings, with the model's tokenizer")
# What `--middleware` names on a hooked server: streams end on shutdown
# (`shutdown`), beam search is refused (`beam_search`), an `n > 1`
# request's samples stay on one engine core (`data_parallel`).
MIDDLEWARE = ("vllm_sequence_hooks.shutdown.FinishStreamsOnShutdown",
              "vllm_sequence_hooks.beam_search.RefuseBeamSearch",
              "vllm_sequence_hooks.data_parallel.SamplesOnOneEngine")
# What the plugin carries out: every action a format may ask for, so it
# serves every registered format (`sequence_hooks.formats`).
CAPABILITIES = frozenset(ENGINE_CAPABILITIES)
# This process's checked configurations (`special_kwargs_of`).
_CHECKED: dict[tuple, SpecialKwargs] = {}


def refuse_unservable(vllm_config: VllmConfig) -> None:
    """Refuses an engine configuration the hooks cannot serve. Checked in
    the API process before any engine core starts
    (`engine_args.check_hooks_config`) and again by the scheduler, for an
    engine built without `EngineArgs`.

    Args:
        vllm_config: The engine's configuration.

    Raises:
        ValueError: for speculative decoding, prefix caching off, data
            parallelism of a MoE model or `skip_tokenizer_init`.
    """
    if vllm_config.speculative_config is not None:
        raise ValueError("special_kwargs: sequence hooks do not support "
                         "speculative decoding: a hook acts on one sampled "
                         "token a step")
    if not vllm_config.cache_config.enable_prefix_caching:
        raise ValueError("special_kwargs: sequence hooks on V1 share the "
                         "parent's KV blocks through the prefix cache: keep "
                         "enable_prefix_caching on")
    # vLLM gives each engine core of a dense model its own configuration
    # with data_parallel_size 1 (`reconfigure_for_independent_dp_rank`): its
    # engines are independent. A MoE model's engine cores step in lockstep
    # (`DPEngineCoreProc`: dummy batches, collective waves).
    if (vllm_config.parallel_config.data_parallel_size > 1
            and vllm_config.model_config.is_moe):
        raise ValueError("special_kwargs: sequence hooks do not support "
                         "data parallelism of MoE models: their engine cores "
                         "step in lockstep, which has never run with hooks; "
                         "dense models run with --data-parallel-size N")
    if vllm_config.model_config.skip_tokenizer_init:
        raise ValueError(SKIP_TOKENIZER_INIT)


def special_kwargs_of(vllm_config: VllmConfig) -> SpecialKwargs:
    """The hooks' configuration of an engine, read and checked against its
    model: the one check of the API process (`engine_args`), the engine
    core (the scheduler) and the workers (the request check), run once a
    process (its result kept, by what was given and the model's tokens),
    each refusal the same text (`checked_special_kwargs`).

    Args:
        vllm_config: The engine's configuration.

    Returns:
        The SpecialKwargs in `additional_config["special_kwargs"]`, every
        token given by id.

    Raises:
        ValueError: if it is missing, invalid, or a token is not one of the
            model's, outside its vocabulary or its end-of-sequence token.
    """
    raw = (vllm_config.additional_config or {}).get(CONFIG_KEY)
    if raw is None:
        raise ValueError(f"sequence hooks need additional_config="
                         f"{{'{CONFIG_KEY}': {{...}}}}")
    model_config = vllm_config.model_config
    model = ModelTokens(lambda: cached_tokenizer_from_config(model_config),
                        model_config.get_vocab_size(),
                        model_config.hf_config.eos_token_id)
    # The repr tells apart every value `SpecialKwargs.parse` tells apart.
    key = (repr(raw), model_config.tokenizer, model_config.tokenizer_mode,
           model_config.tokenizer_revision, model_config.trust_remote_code,
           model.vocab_size, repr(model.eos_token_id))
    if key not in _CHECKED:
        _CHECKED[key] = checked_special_kwargs(raw,
                                               model,
                                               capabilities=CAPABILITIES)
    return _CHECKED[key]


def names_scheduler(vllm_config: VllmConfig) -> bool:
    """Whether `--scheduler-cls` names the plugin's scheduler."""
    return _is_scheduler(vllm_config.scheduler_config.scheduler_cls)


def names_request_check(vllm_config: VllmConfig) -> bool:
    """Whether `--logits-processors` names the hooks' request check."""
    return any(
        _is_request_check(entry)
        for entry in vllm_config.model_config.logits_processors or ())


def hooked_settings(special_kwargs: Any,
                    settings: Mapping[str, Any],
                    server: bool = False) -> dict[str, Any]:
    """The engine settings that turn the hooks on, added to ``settings``.

    What `--special-kwargs` and `special_kwargs=` expand into (the five
    flags of a hooked server, three for an engine): `scheduler_cls`, the
    `special_kwargs` key of `additional_config`, the request check
    appended to `logits_processors` (processors of the caller's own stay,
    before it) and, with ``server``, the two `middleware` appended. Applied
    twice, it changes nothing the second time.

    Args:
        special_kwargs: A SpecialKwargs, a dict of its fields or its JSON.
        settings: The settings given so far, by engine-argument name
            (missing or None: not given).
        server: Whether the settings are a server's (`middleware`).

    Returns:
        The changed settings only.

    Raises:
        UnsupportedVllmVersion: on a vLLM the plugin was not tested on.
        ValueError: if ``special_kwargs`` is invalid, or a setting given
            conflicts with it: another scheduler, or other hooks in
            `additional_config`.
    """
    check_vllm_version()
    parsed = checked_special_kwargs(special_kwargs, capabilities=CAPABILITIES)
    fields = fields_of(parsed)
    scheduler_cls = settings.get("scheduler_cls")
    if scheduler_cls is not None and not _is_scheduler(scheduler_cls):
        raise ValueError(
            f"special_kwargs runs the hooks' scheduler ({SCHEDULER_CLS}); "
            f"scheduler_cls={scheduler_cls!r} given beside it conflicts: "
            "drop it (the hooks' scheduler is upstream's, async or not, "
            "with the hooks)")
    additional_config = dict(settings.get("additional_config") or {})
    given = additional_config.get(CONFIG_KEY)
    if given is not None and checked_special_kwargs(
            given, capabilities=CAPABILITIES) != parsed:
        raise ValueError(
            f"special_kwargs={fields!r} and additional_config"
            f"[{CONFIG_KEY!r}]={given!r} conflict: give the hooks once")
    additional_config[CONFIG_KEY] = fields
    processors = list(settings.get("logits_processors") or ())
    if not any(_is_request_check(entry) for entry in processors):
        processors.append(REQUEST_CHECK)
    changed = {
        "scheduler_cls": SCHEDULER_CLS,
        "additional_config": additional_config,
        "logits_processors": processors,
    }
    if server:
        middleware = list(settings.get("middleware") or ())
        changed["middleware"] = middleware + [
            name for name in MIDDLEWARE if name not in middleware
        ]
    return changed


def hooked_engine_args(special_kwargs: Any) -> dict[str, Any]:
    """Engine arguments that turn the hooks on, for `LLM(**...)`.

    `LLM(model, special_kwargs=...)` does the same once the plugin is
    imported (`engine_args`).

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
    return hooked_settings(special_kwargs, {})


def _is_scheduler(scheduler_cls: Any) -> bool:
    if not isinstance(scheduler_cls, str):
        scheduler_cls = (getattr(scheduler_cls, "__module__", "") + "." +
                         getattr(scheduler_cls, "__qualname__", ""))
    return scheduler_cls == SCHEDULER_CLS


def _is_request_check(entry: Any) -> bool:
    if isinstance(entry, str):
        return entry.replace(":", ".") == REQUEST_CHECK.replace(":", ".")
    return (getattr(entry, "__module__", "") + ":" +
            getattr(entry, "__qualname__", "")) == REQUEST_CHECK
