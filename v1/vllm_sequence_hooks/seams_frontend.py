# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The upstream members the plugin reaches outside the engine core: how
the frontend fans out samples, makes request outputs and checks stop
strings; the request check (`admission`, a logits processor); the
trainer's colocated engine (`vllm_sequence_hooks_rl`); the API server's
shutdown (`shutdown`) and metrics (`server_metrics`). Rows of
`seams.SEAMS`.
"""

from vllm_sequence_hooks.seams_types import (NEVER_GIVEN, PUBLIC_API,
                                             SAMPLE_INFO, STOP_STRINGS,
                                             TREE_CHANNEL, Seam)

_ADMISSION = ("V1 lets a scheduler plugin refuse a request in the frontend, "
              "with a reason")
_SHUTDOWN = ("upstream's shutdown gives every open request a final output "
             "before uvicorn waits for their streams")
_METRICS = ("upstream shows the engine core's metrics with one API server "
            "too, or gives plugins a metrics channel")

FRONTEND_SEAMS: tuple[Seam, ...] = (
    # The frontend.
    Seam(
        "vllm.v1.engine.parallel_sampling:ParentRequest.get_child_info",
        "relies on", "a sample's engine request id is `<index>_<request id>` "
        "(`transport.SAMPLE_ID`)", SAMPLE_INFO),
    Seam(
        "vllm.v1.engine.parallel_sampling:ParentRequest.get_outputs",
        "relies on",
        "with `n > 1` the request's output is made from the last sample "
        "to finish (streamed: each sample's own)", SAMPLE_INFO),
    Seam(
        "vllm.v1.engine.output_processor:RequestState.make_request_output",
        "relies on",
        "`RequestOutput.kv_transfer_params` is the engine-core output's it "
        "is made from, nothing kept from earlier ones", TREE_CHANNEL),
    Seam(
        "vllm.v1.engine.output_processor:OutputProcessor.process_outputs",
        "relies on", "the frontend's stop-string check the core repeats (same "
        "detokenizer and tokens; `ABORT` becomes `STOP`); it passes each "
        "output's `kv_transfer_params` on", STOP_STRINGS),
    Seam(
        "vllm:CompletionOutput.{index,text,token_ids,logprobs,"
        "cumulative_logprob}", "reads",
        "`promise_tree` takes a sample's tree by index and its root's text "
        "and logprobs from the sample", PUBLIC_API),
    Seam("vllm:CompletionOutput.finished", "calls",
         "a sample's tree comes with its final output", PUBLIC_API),
    Seam("vllm:RequestOutput.{outputs,kv_transfer_params}", "reads",
         "`promise_tree` reads the tree the engine core sent", TREE_CHANNEL),
    # The request check (`admission`).
    Seam(
        "vllm.v1.sample.logits_processor:LogitsProcessor", "subclasses",
        "`HookedRequestCheck` is the hooks' request check: vLLM calls its "
        "`validate_params` on every request in the frontend and builds it "
        "in each worker before the model loads", _ADMISSION),
    Seam("vllm.v1.sample.logits_processor:LogitsProcessor.validate_params",
         "overrides", "structured outputs refused per request, before the "
         "engine", _ADMISSION),
    Seam(
        "vllm.v1.sample.logits_processor:validate_logits_processors_parameters",
        "relies on", "a `ValueError` of `validate_params` becomes vLLM's "
        "`VLLMValidationError`: a 400 with its text", _ADMISSION),
    Seam(
        "vllm.v1.sample.logits_processor:_load_logitsprocs_plugins",
        "relies on", "every V1 engine builds the processors registered under "
        "`vllm.logits_processors` in each worker: `HooksConfigCheck` refuses "
        "`special_kwargs` without the plugin's scheduler (`config_check`)",
        "V1 lets a plugin check the engine's configuration at start"),
    Seam("vllm.v1.sample.logits_processor:BatchUpdate", "annotates",
         "`update_state`'s parameter", NEVER_GIVEN),
    Seam("vllm.sampling_params:SamplingParams.structured_outputs", "reads",
         "a request with structured outputs is refused", PUBLIC_API),
    Seam(
        "vllm.config:ModelConfig.logits_processors", "reads",
        "the scheduler refuses to start unless `--logits-processors` names "
        "the request check", PUBLIC_API),
    # GRPO on promise trees (`vllm_sequence_hooks_rl`): TRL's colocated
    # engine, hooked.
    Seam(
        "vllm.entrypoints.llm:LLM.{generate,collective_rpc,"
        "reset_prefix_cache,get_tokenizer,llm_engine}", "calls",
        "tree rollouts on TRL's colocated engine, the trainer's weights "
        "loaded between them, the prefix cache reset after a load, the "
        "hook ids; the engine's `additional_config`", PUBLIC_API),
    Seam(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.reload_weights",
        "calls", "the trainer's weights into the engine, through "
        "`LLM.collective_rpc` and the worker's `reload_weights`, all at once "
        "and repacked: the CPU backend cannot take a tensor at a time after "
        "start (its workers inherit both)", "never: vLLM's weight reload"),
    Seam(
        "vllm.model_executor.layers.vocab_parallel_embedding:"
        "UnquantizedEmbeddingMethod.process_weights_after_loading",
        "relies on", "after a reload, a tied output layer is processed "
        "again: on CPU it repacks the linear kernel's copy of the weights "
        "(`reload_weights` leaves the old copy)",
        "vLLM's reload re-processes tied layers"),
    # Shutdown (`shutdown`, ASGI middleware of the API server).
    Seam(
        "vllm.entrypoints.launchers.launcher:serve_http", "relies on",
        "on SIGTERM it stops the engine client before uvicorn, whose "
        "graceful shutdown waits for open streams; it puts uvicorn's "
        "server in `app.state.server`", _SHUTDOWN),
    Seam(
        "vllm.v1.engine.async_llm:AsyncLLM.shutdown", "relies on",
        "stopping the engine core may leave every request without a final "
        "output (a race with the output handler's cancel)", _SHUTDOWN),
    Seam("vllm.v1.engine.async_llm:AsyncLLM.{errored,output_processor}",
         "reads", "the engine client is dead; the requests the frontend "
         "holds", _SHUTDOWN),
    Seam("vllm.v1.engine.output_processor:OutputProcessor.request_states",
         "reads", "the open requests, by id", _SHUTDOWN),
    Seam(
        "vllm.v1.engine.output_processor:OutputProcessor.abort_requests",
        "calls", "ends each open request's stream with finish reason "
        "`abort`, as a client's abort does", _SHUTDOWN),
    # The engine core's metrics on a one-API-server `/metrics`
    # (`server_metrics`).
    Seam(
        "vllm.v1.metrics.prometheus:get_prometheus_registry", "relies on",
        "with `PROMETHEUS_MULTIPROC_DIR` set, `/metrics` reads every "
        "process's metrics from the folder", _METRICS),
)
