# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Engine-start set-up of sequence hooks: needed options and refusals.

`EngineArgs.create_engine_config` calls `prepare_engine_args` before it
builds anything and `check_engine_config` on the result, so every
configuration the hooks cannot serve fails at start with a reason.
"""

from typing import TYPE_CHECKING

import vllm.envs as envs
from sequence_hooks.formats import FORK, PARK_RESUME
from sequence_hooks.special_kwargs import ModelTokens, checked_special_kwargs
from vllm.core.sequence_hook_scheduler import SequenceHookScheduler
from vllm.transformers_utils.tokenizer import get_tokenizer
from vllm.utils import resolve_obj_by_qualname

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

STOCK_SCHEDULER = "vllm.core.scheduler.Scheduler"
HOOK_SCHEDULER = (f"{SequenceHookScheduler.__module__}."
                  f"{SequenceHookScheduler.__qualname__}")
# What this engine carries out (`sequence_hooks.formats`): a child on its
# parent's KV and a park and resume; a format that needs more (a branch's
# own stop ids, a conclusion, a call made anew, ...) is refused at start,
# naming what is missing.
CAPABILITIES = frozenset({FORK, PARK_RESUME})


def prepare_engine_args(args: "EngineArgs") -> None:
    """Sets the options hooks need where the user left the defaults.

    Args:
        args: Engine arguments with `special_kwargs` set; changed in place.

    Raises:
        ValueError: if an explicit choice conflicts with the hooks.
    """
    args.special_kwargs = checked_special_kwargs(args.special_kwargs,
                                                 capabilities=CAPABILITIES)
    if envs.is_set("VLLM_USE_V1") and envs.VLLM_USE_V1:
        refuse("the V1 engine (VLLM_USE_V1=1): hooks run in the V0 engine; "
               "unset VLLM_USE_V1 or set it to 0")
    if args.speculative_config:
        refuse("speculative decoding: hooks act on one sampled token a step")
    if args.num_scheduler_steps > 1:
        refuse("multi-step scheduling (num_scheduler_steps > 1): hooks act "
               "on every step's token")
    if args.pipeline_parallel_size > 1:
        refuse("pipeline parallelism > 1: hooks park and resume groups in "
               "the one scheduler")
    if args.preemption_mode == "swap":
        refuse("preemption_mode='swap': parked parents could hold the blocks "
               "swapped-out children need to come back; hooks preempt by "
               "recompute")
    if args.enable_chunked_prefill is False:
        refuse("enable_chunked_prefill=False: a resumed parent prefills its "
               "merged tokens on top of its KV cache as a prefill chunk")
    if args.scheduler_cls == STOCK_SCHEDULER:
        args.scheduler_cls = HOOK_SCHEDULER
    else:
        scheduler_cls = args.scheduler_cls
        if isinstance(scheduler_cls, str):
            scheduler_cls = resolve_obj_by_qualname(scheduler_cls)
        if not (isinstance(scheduler_cls, type)
                and issubclass(scheduler_cls, SequenceHookScheduler)):
            refuse(f"scheduler_cls={args.scheduler_cls!r}: it must subclass "
                   f"{HOOK_SCHEDULER}")
    if not envs.is_set("VLLM_USE_V1"):
        envs.set_vllm_use_v1(False)
    args.enable_chunked_prefill = True
    # A token's hook must act before the next step is scheduled.
    args.disable_async_output_proc = True


def check_engine_config(config: "VllmConfig") -> None:
    """Resolves token strings; refuses what the hooks cannot serve.

    Args:
        config: The engine configuration, with `special_kwargs` set.

    Raises:
        ValueError: naming what is refused and why.
    """
    model_config = config.model_config
    if model_config.is_encoder_decoder:
        refuse("encoder-decoder models: children fork decoder sequences only")
    if model_config.is_attention_free or model_config.has_inner_state:
        refuse("models with per-request state (Mamba, hybrid or attention-"
               "free): a child forks only the KV cache")
    if model_config.runner_type != "generate":
        refuse(f"runner type {model_config.runner_type!r}: hooks act on "
               "generated tokens")
    if model_config.skip_tokenizer_init:
        refuse("skip_tokenizer_init=True: merging children tokenizes their "
               "texts")
    if config.scheduler_config.send_delta_data:
        refuse("Ray SPMD workers with delta data (VLLM_USE_RAY_SPMD_WORKER=1"
               "): a child's first step would reach workers as a delta for a "
               "sequence they never saw")
    if not config.scheduler_config.chunked_prefill_enabled:
        refuse("a configuration without chunked prefill (the platform turned"
               " it off)")
    if model_config.use_async_output_proc:
        refuse("async output processing")
    config.special_kwargs = checked_special_kwargs(
        config.special_kwargs,
        ModelTokens(
            lambda: get_tokenizer(model_config.tokenizer,
                                  tokenizer_mode=model_config.tokenizer_mode,
                                  trust_remote_code=model_config.
                                  trust_remote_code,
                                  revision=model_config.tokenizer_revision),
            model_config.get_vocab_size(),
            model_config.hf_config.eos_token_id),
        capabilities=CAPABILITIES)


def refuse(what: str) -> None:
    """Raises the error for a configuration the hooks cannot serve."""
    raise ValueError(
        f"special_kwargs (sequence hooks) cannot be used with {what}.")
