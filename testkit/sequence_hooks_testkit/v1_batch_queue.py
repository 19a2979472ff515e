# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A model-free V1 engine core: a real scheduler driven as the engine core
drives it, with no model.

`make_scheduler` builds a real V1 scheduler (the plugin's, or stock
`Scheduler`/`AsyncScheduler`) over a real `KVCacheManager`, configured as
for the tiny model, async scheduling on or off as asked (the CPU platform
forces it off; on GPUs it is on by default, so this is how it is proven
here). `BatchQueueDriver` runs it as `EngineCore.step_with_batch_queue`
does: with two batches allowed in flight it schedules step N+1 before step
N's output comes back, and it plays the model runner's part with a
scripted sampler that picks each token from its request's own position.
"""

import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from vllm import SamplingParams  # noqa: E402
from vllm.config import SchedulerConfig  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher  # noqa: E402
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

# Stands in for any token that is not a hook token or the end.
FILLER = 7


def make_scheduler(scheduler_cls: type,
                   model_path: Path,
                   async_scheduling: bool,
                   special_kwargs: Optional[dict] = None,
                   block_size: int = 16,
                   num_blocks: int = 1000,
                   max_num_seqs: int = 64,
                   max_model_len: int = 512,
                   request_check: bool = True,
                   policy: str = "fcfs",
                   **config: Any):
    """A real V1 scheduler of ``scheduler_cls`` with no model behind it.

    Args:
        scheduler_cls: The class, as `--scheduler-cls` would name it.
        model_path: The tiny model's folder (configs and tokenizer only).
        async_scheduling: Whether vLLM's configuration has it on.
        special_kwargs: The hooks' configuration, for the plugin's class.
        block_size: KV block size.
        num_blocks: KV blocks in the pool.
        max_num_seqs: Requests scheduled at once.
        max_model_len: Longest sequence.
        request_check: Whether `--logits-processors` names the hooks'
            request check (with ``special_kwargs`` only).
        policy: The scheduling policy, "fcfs" or "priority".
        config: `VllmConfig` fields to set before the scheduler is made.
    """
    model_config = ModelConfig(
        model=str(model_path),
        dtype="float32",
        max_model_len=max_model_len,
        # The hooks' request check, as `hooked_engine_args` names it.
        logits_processors=([
            "vllm_sequence_hooks.admission:HookedRequestCheck"
        ] if special_kwargs is not None and request_check else None))
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=block_size,
                                 enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=max(
                                             2048, max_model_len),
                                         max_model_len=max_model_len,
                                         is_encoder_decoder=False,
                                         policy=policy),
        additional_config=({} if special_kwargs is None else {
            "special_kwargs": special_kwargs
        }))
    # The platform's choice (off on the CPU) overridden, as a GPU has it.
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    for name, value in config.items():
        setattr(vllm_config, name, value)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer"],
                             FullAttentionSpec(block_size=block_size,
                                               num_kv_heads=1,
                                               head_size=1,
                                               dtype=torch.float32))
        ])
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=block_size)


def make_request(scheduler,
                 request_id: str,
                 prompt: list[int],
                 max_tokens: int,
                 eos: int,
                 priority: int = 0,
                 stop_token_ids: Sequence[int] = (),
                 **params: Any) -> Request:
    """A request as the engine core makes one (block hashes for prefix
    caching included, ``eos`` its EOS as the frontend sets it);
    ``stop_token_ids``: its own, besides ``eos``; ``params``: more
    `SamplingParams`."""
    hash_fn = get_hash_fn_by_name(
        scheduler.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    sampling_params = SamplingParams(max_tokens=max_tokens,
                                     stop_token_ids=[eos, *stop_token_ids],
                                     **params)
    sampling_params.update_from_generation_config({}, eos)
    return Request(request_id=request_id,
                   prompt_token_ids=list(prompt),
                   sampling_params=sampling_params,
                   pooling_params=None,
                   priority=priority,
                   block_hasher=get_request_block_hasher(
                       scheduler.block_size, hash_fn))


# Picks a request's next token from (request id, position among its own
# tokens); the driver knows where each request's own tokens start.
Sampler = Callable[[str, int], int]


@dataclass
class BatchQueueDriver:
    """Drives a scheduler as the engine core's batch queue does.

    Args:
        scheduler: A V1 scheduler (`make_scheduler`).
        sample: The scripted sampler.
        depth: Batches allowed in flight (2 with async scheduling, as the
            engine core's `max_concurrent_batches`; 1 without).
    """

    scheduler: Any
    sample: Sampler
    depth: int = 2
    # Steps scheduled while another batch was in flight.
    overlapped: int = 0
    # Steps scheduled.
    steps: int = 0
    # Every engine core output given back, in order: (request id, new
    # token ids, finish reason).
    outputs: list[tuple[str, list[int],
                        Optional[str]]] = field(default_factory=list)
    # The trees finished roots' outputs carried (`kv_transfer_params`), by
    # request id.
    trees: dict[str, dict] = field(default_factory=dict)
    # Where each request's own tokens start, by request id.
    starts: dict[str, int] = field(default_factory=dict)
    _queue: deque = field(default_factory=deque)
    # The request object each id's start is of.
    _requests: dict[str, Request] = field(default_factory=dict)

    def add(self, request: Request) -> None:
        self.starts[request.request_id] = request.num_prompt_tokens
        self._requests[request.request_id] = request
        self.scheduler.add_request(request)

    def step(self) -> None:
        """One call of `step_with_batch_queue`: schedule a batch if the
        queue has room, else wait for the oldest and give its output
        back."""
        scheduler = self.scheduler
        if len(self._queue) < self.depth and scheduler.has_requests():
            output = scheduler.schedule()
            if output.total_num_scheduled_tokens > 0:
                self.steps += 1
                self.overlapped += bool(self._queue)
                self._queue.appendleft((output, self._sampled(output)))
                if len(self._queue) < self.depth:
                    return
            elif not self._queue:
                return
        if self._queue:
            output, sampled = self._queue.pop()
            self._give_back(output, sampled)

    def run(self, max_calls: int = 100000) -> None:
        """Steps until nothing is left to schedule or give back."""
        for _ in range(max_calls):
            if not (self.scheduler.has_requests() or self._queue):
                return
            self.step()
        raise AssertionError(f"not done after {max_calls} calls")

    def run_until(self, reached: Callable[[Any], bool], what: str) -> None:
        """Steps until ``reached(scheduler)`` holds after a step.

        Raises:
            AssertionError: The run ended first.
        """
        for _ in range(100000):
            if not (self.scheduler.has_requests() or self._queue):
                break
            self.step()
            if reached(self.scheduler):
                return
        raise AssertionError(f"never reached: {what}")

    def abort(self, request_id: str) -> None:
        """Aborts a request as the engine core does for the frontend
        (`EngineCore.abort_requests`), then steps until nothing is left."""
        self.scheduler.finish_requests(request_id,
                                       RequestStatus.FINISHED_ABORTED)
        self.run()

    def _sampled(self, output: SchedulerOutput) -> dict[str, int]:
        """The token each scheduled request samples in this step, decided
        at schedule time as a model runner would from the request's
        position (placeholders of earlier steps in flight included)."""
        sampled = {}
        for request_id in output.num_scheduled_tokens:
            request = self.scheduler.requests[request_id]
            if request.num_computed_tokens < request.num_tokens:
                # A prefill chunk that ends before the prompt's end.
                continue
            if self._requests.get(request_id) is not request:
                # A request the hooks made (a child, a call made anew):
                # its context is its prompt.
                self._requests[request_id] = request
                self.starts[request_id] = request.num_prompt_tokens
            position = request.num_computed_tokens - self.starts[request_id]
            sampled[request_id] = self.sample(request_id, position)
        return sampled

    def _give_back(self, output: SchedulerOutput, sampled: dict[str,
                                                                int]) -> None:
        req_ids = list(output.num_scheduled_tokens)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={
                r: i
                for i, r in enumerate(req_ids)
            },
            sampled_token_ids=[[sampled[r]] if r in sampled else []
                               for r in req_ids])
        engine_outputs = self.scheduler.update_from_output(
            output, runner_output)
        for outputs in engine_outputs.values():
            for out in outputs.outputs:
                self.outputs.append(
                    (out.request_id, list(out.new_token_ids), None
                     if out.finish_reason is None else str(out.finish_reason)))
                tree = (out.kv_transfer_params or {}).get("promise_tree")
                if tree is not None:
                    self.trees[out.request_id] = tree


def own_tokens(scheduler, request_id: str) -> int:
    """The tokens the scheduler's request ``request_id`` has sampled (-1
    if it holds no such request)."""
    request = scheduler.requests.get(request_id)
    return -1 if request is None else request.num_output_tokens


def fork_stages(before: str, member: str,
                first_end: int) -> dict[str, Callable[[Any], bool]]:
    """The points before its join where a tree that forks in two is
    aborted in the abort tests, by what the scheduler holds after a step:
    the root "r0" writing, both members running, the first ended and the
    second ("r0/promise-1", the longer) running on.

    Args:
        before: What the root writes before it forks, as the first
            stage's name says it ("before the fork").
        member: What the format calls a member ("path": "paths running",
            "one path ended").
        first_end: The first member's own tokens at its end.

    Returns:
        ``reached(scheduler)`` by stage name, in the order they are
        reached, for `BatchQueueDriver.run_until`.
    """
    return {
        f"before {before}":
        lambda s: own_tokens(s, "r0") >= 3,
        f"{member}s running":
        lambda s: own_tokens(s, "r0/promise-1") >= 2,
        f"one {member} ended":
        lambda s: "r0/promise-0" not in s.requests and own_tokens(
            s, "r0/promise-1") > first_end,
    }


def run_greedy(scheduler, next_token: Callable[[list[int]], int],
               request: Request) -> BatchQueueDriver:
    """Drives ``request`` on ``scheduler`` without async scheduling to its
    end, each sampled token ``next_token`` of the whole context of the
    request it is for (a scripted greedy model); then asserts that no
    request is left and every block but the pool's null block is free.

    Returns:
        The driver, run.
    """

    def sample(request_id: str, position: int) -> int:
        # Without async scheduling, a request's context is all its tokens.
        return next_token(scheduler.requests[request_id].all_token_ids)

    driver = BatchQueueDriver(scheduler, sample, depth=1)
    driver.add(request)
    driver.run()
    assert scheduler.requests == {}
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    return driver
