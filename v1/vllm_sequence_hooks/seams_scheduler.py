# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The upstream members the scheduler reaches in the engine core: V1's
`Scheduler` (subclassed: overridden methods, private members called or
relied on, attributes), the KV cache and the request queues, requests,
engine-core outputs and logprobs, the tokenizer and the frontend's
detokenizer run in the core, and sampling parameters. Rows of
`seams.SEAMS`.
"""

from vllm_sequence_hooks.seams_types import (NEVER_GIVEN, PUBLIC_API,
                                             SAMPLE_INFO, STOP_STRINGS,
                                             TREE_CHANNEL, Seam)

_SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
_KV = "vllm.v1.core.kv_cache_manager:KVCacheManager"
_DETOK = "vllm.v1.engine.detokenizer"
_STATE = "never: a request's own state"
_FORK = "upstream V1 can fork a request onto its parent's KV blocks"
_PARK = ("upstream V1 can park a running request as a streaming session "
         "and resume it with new input from the scheduler")
_EVICT = "upstream V1 evicts parked sessions under KV pressure"

SCHEDULER_SEAMS: tuple[Seam, ...] = (
    # The scheduler: overridden methods.
    Seam(
        f"{_SCHED}.__init__", "overrides",
        "`SequenceHookScheduler` adds its hooks and KV parking after it, "
        "which read what it sets; `SequenceHookScheduler.__new__` "
        "finds `vllm_config` by this name (keyword or first)", NEVER_GIVEN),
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
        "is uncounted); None also finishes, and returns, the format "
        "roots between calls, which hold no request", "never: aborts "
        "arrive here"),
    Seam(
        f"{_SCHED}.add_request", "overrides",
        "notes each sample of an `n > 1` request as it arrives (a new id "
        "is queued and put in `requests`)", SAMPLE_INFO),
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
        "`KvParking.park` repeats how it drops a finished "
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
        "child's budget", NEVER_GIVEN),
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
        "eviction; the KV usage gauge", NEVER_GIVEN),
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
        "(`scheduler.order_queues`)",
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
         NEVER_GIVEN),
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
        "the API's response", TREE_CHANNEL),
    Seam(
        "vllm.v1.engine:EngineCoreOutputs", "constructs, writes",
        "children's outputs are dropped from `outputs`; a client with "
        "only added outputs gets a new batch", "never: the scheduler's "
        "outputs"),
    Seam(
        "vllm.v1.engine:EngineCoreOutput.events", "reads, writes",
        "a child's `PREEMPTED` events go out with its root's next output "
        "(`transport.preemptions`, held in the root's record), so "
        "`vllm:num_preemptions` counts them",
        "never: the scheduler's outputs"),
    Seam("vllm.v1.engine:EngineCoreEvent.type", "reads",
         "which held events are a child's preemptions", NEVER_GIVEN),
    Seam("vllm.v1.engine:EngineCoreEventType.PREEMPTED", "reads",
         "the events the frontend counts as preemptions", NEVER_GIVEN),
    Seam(
        "vllm.v1.engine:FinishReason.{STOP,ABORT}", "reads",
        "a stop found in the core goes out as `ABORT`, which the frontend "
        "turns into `STOP` when it finds the same stop", STOP_STRINGS),
    Seam("vllm.v1.engine:FinishReason.__str__", "relies on",
         "a member's finish reason in the tree is `str(finish_reason)`",
         "never: the tree's reasons are V0's names"),
    Seam("vllm.v1.engine:FINISH_REASON_STRINGS", "relies on",
         "the names `str` gives: `stop`, `length`, `abort`, as on V0",
         "never: the tree's reasons are V0's names"),
    Seam(
        "vllm.v1.outputs:LogprobsLists", "constructs, reads",
        "a child's (and a held root's) sampled logprobs are kept for its "
        "node; merged tokens' rows and a held root's whole output's are "
        "built (the first three fields)", "never: the outputs' logprobs form"),
    Seam(
        "vllm.v1.engine:EngineCoreOutput.{new_prompt_logprobs_tensors,"
        "prompt_token_id_logprobs}", "reads, writes",
        "a held root's outputs are held back: its prompt logprobs (whole in "
        "one output, as upstream gives them with the first sampled token) "
        "go with its whole output", "never: the scheduler's outputs"),
    Seam(
        "vllm.v1.outputs:LogprobsLists.slice_request", "calls",
        "a root stopped inside a merge keeps the rows of the tokens up to "
        "the stop, as vLLM 0.32's frontend cuts them", STOP_STRINGS),
    Seam("vllm.v1.outputs:ModelRunnerOutput", "annotates",
         "`update_from_output`'s parameter", NEVER_GIVEN),
    Seam(
        "vllm.logprobs:append_logprobs_for_next_position", "calls",
        "a child's logprobs in `CompletionOutput.logprobs`' form; a held "
        "root's rows are rebuilt from it by its ranks (the sampled "
        "token's, then 1 to k)",
        "the tree takes `LogprobsLists` rows as they are"),
    Seam(
        "vllm.logprobs:Logprob", "constructs",
        "`PromiseNode.from_dict(data, Logprob)` rebuilds the tree's "
        "entries as `Logprob(logprob, rank)`", PUBLIC_API),
    # Tokenizer and the frontend's detokenizer, run in the engine core.
    Seam(
        "vllm.tokenizers:cached_tokenizer_from_config", "calls",
        "the model's tokenizer, in the engine core: hook tokens, merge "
        "text, members' texts", PUBLIC_API),
    Seam(
        "vllm.tokenizers:TokenizerLike.{encode,decode,convert_ids_to_tokens,"
        "convert_tokens_to_ids}", "calls",
        "what `SpecialKwargs.resolve` and the merge call; they also pass "
        "Hugging Face's `tokenize` and `split_special_tokens` (the "
        "tokenizer is Hugging Face's)", PUBLIC_API),
    Seam("vllm.utils.math_utils:cdiv", "calls", "blocks of a token count",
         "whenever: a one-line helper"),
    Seam(
        f"{_DETOK}:IncrementalDetokenizer.from_new_request", "calls",
        "the frontend's own detokenizer, in the core: children's and "
        "tree-carrying roots' stop strings, members' texts", STOP_STRINGS),
    Seam(f"{_DETOK}:IncrementalDetokenizer.update", "calls",
         "feeds tokens; returns the stop string found, if any", STOP_STRINGS),
    Seam(
        f"{_DETOK}:BaseIncrementalDetokenizer.update", "relies on",
        "the update the frontend's detokenizer runs: where it cuts the "
        "text and the tokens at a stop string (0.31 keeps the tokens fed "
        "with the one that completes it, 0.32 drops them)", STOP_STRINGS),
    Seam(
        f"{_DETOK}:BaseIncrementalDetokenizer.{{output_text,"
        "output_token_ids}", "reads",
        "a stopped member's text and tokens, cut where the frontend cuts "
        "them", STOP_STRINGS),
    Seam(
        "vllm.v1.engine:EngineCoreRequest.{request_id,prompt_token_ids,"
        "prompt_embeds,sampling_params}", "imitates",
        "the detokenizer is built from a stand-in with these fields of the "
        "frontend's request, which the core does not have", STOP_STRINGS,
        (f"{_DETOK}:IncrementalDetokenizer.from_new_request",
         f"{_DETOK}:BaseIncrementalDetokenizer.__init__",
         f"{_DETOK}:FastIncrementalDetokenizer.__init__",
         f"{_DETOK}:SlowIncrementalDetokenizer.__init__")),
    Seam("vllm.sampling_params:SamplingParams.clone", "calls",
         "a child's parameters; a text without stop strings", PUBLIC_API),
    Seam(
        "vllm.sampling_params:SamplingParams.{stop,seed,min_tokens,"
        "max_tokens,logprobs,num_logprobs,prompt_logprobs,"
        "prompt_logprob_token_ids,skip_reading_prefix_cache,stop_token_ids,"
        "skip_special_tokens}", "reads, writes",
        "a child's seed, budget and minimum; no prompt logprobs for a "
        "member's call after its first (nor the prefix-cache skip they "
        "set: its prompt is its context, which the cache holds); stop "
        "strings; whether and how many logprobs are kept (`num_logprobs`, "
        "as the frontend counts them); a format's branch stops at its "
        "end tag; a concluded root's text as the frontend decodes it",
        PUBLIC_API),
    Seam(
        "vllm.sampling_params:SamplingParams._all_stop_token_ids", "writes",
        "a format's branch stops at its end tag: the ids `min_tokens` holds "
        "back must include it, as `__post_init__` adds a request's own "
        "stop ids", "SamplingParams can add stop ids after construction "
        "(or `clone` takes changes); could go upstream"),
)
