# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The upstream members a join that splices KV reaches: the worker and its
V1 model runner in each worker process (`splice_runner`), the KV cache
manager's blocks and the requests' block hashes in the engine core
(`splicing`). Rows of `seams.SEAMS`.
"""

from vllm_sequence_hooks.seams_types import PUBLIC_API, Seam

_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_POSITIONS = ("upstream V1 takes a per-request position offset (or map) "
              "from the scheduler")
_SPLICE = ("upstream V1 lets the scheduler give a request blocks other "
           "requests computed")

RUNNER_SEAMS: tuple[Seam, ...] = (
    Seam(
        "vllm.config:ParallelConfig.worker_cls", "reads, writes",
        "the platform's resolved worker (`CPUWorker`) is swapped for "
        "`SpliceCPUWorker` when the format splices; any other refused",
        PUBLIC_API),
    Seam("vllm.v1.worker.cpu_worker:CPUWorker", "subclasses",
         "`SpliceCPUWorker` overrides `init_device` alone", _POSITIONS),
    Seam(
        "vllm.v1.worker.cpu_worker:CPUWorker.init_device", "overrides",
        "after upstream builds the model runner, its class gains "
        "`SpliceRunner`; Model Runner V2 refused", _POSITIONS),
    Seam("vllm.v1.worker.cpu_worker:CPUWorker.use_v2_model_runner", "reads",
         "Model Runner V2 computes positions elsewhere: refused", _POSITIONS),
    Seam(
        f"{_RUNNER}._update_states", "overrides",
        "after upstream's update (finished requests gone, fresh blocks "
        "zeroed, block copies made): the step's position maps kept, fresh "
        "blocks zeroed, token copies made, before the forward", _SPLICE),
    Seam(
        f"{_RUNNER}._prepare_inputs", "overrides",
        "upstream writes `positions` (and the slots from them) from "
        "`num_computed_tokens_cpu` and `query_start_loc`; mapped requests' "
        "positions then move by their deltas, the slots staying the "
        "indices'", _POSITIONS),
    Seam(
        f"{_RUNNER}.{{positions,input_batch,query_start_loc,"
        "kv_cache_config,compilation_config}", "reads, writes",
        "positions moved in place after `_prepare_inputs`; the batch's "
        "request ids and computed counts, the query starts; the cache's "
        "block count; each layer's cache and instruction set from the "
        "static forward context", _POSITIONS),
    Seam("vllm.v1.worker.cpu_model_runner:CPUModelRunner._zero_block_ids",
         "calls", "zeroes the fresh blocks token copies fill in part",
         _SPLICE),
    Seam(
        "vllm._custom_ops:cpu_attn_reshape_and_cache", "calls",
        "writes a probe block once per cache layout, whose values name "
        "each element's token, head, channel and K or V: where a token "
        "lies in a block (the layout depends on the instruction set)",
        "upstream V1 copies single tokens' KV between blocks "
        "(`kv_cache_token_copies` beside `kv_cache_block_copies`)"),
    Seam(
        "vllm.v1.core.sched.output:SchedulerOutput", "relies on",
        "a plain dataclass, pickled whole to every worker: the step's "
        "`SpliceStep` rides in an attribute of its own", _SPLICE),
    Seam(
        "vllm.v1.core.single_type_kv_cache_manager:"
        "SingleTypeKVCacheManager.{req_to_blocks,num_cached_block}", "writes",
        "a join gives the parked member its first path's blocks and fresh "
        "ones, the cached count the leading hashed blocks", _SPLICE),
    Seam(
        "vllm.v1.core.block_pool:BlockPool.{touch,get_new_blocks,"
        "free_blocks}", "calls",
        "a finished path's blocks kept by a reference of ours until its "
        "join; fresh blocks for the later paths' tokens; the copied "
        "paths' blocks freed once the copies ran", _SPLICE),
    Seam(
        "vllm.v1.request:Request.{_block_hasher,block_hashes,"
        "update_block_hashes}", "writes, calls",
        "a member's hashes from its first moved index salted with a value "
        "of its own (its hasher wrapped, its later hashes recomputed): "
        "those blocks are never another request's prefix hit",
        "upstream V1 keys block hashes by positions, or takes a "
        "per-block salt"),
)
