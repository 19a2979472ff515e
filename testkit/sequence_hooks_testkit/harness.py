# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Drives the real scheduler and hook processor step by step, no model.

`HookHarness` wires a real `SequenceHookScheduler` (real block manager),
the output processor the real factory picks, a real detokenizer over the
tiny tokenizer and a real stop checker, then plays the engine's part of a
step: schedule, count the computed tokens, hand each sampled token (chosen
by the test) to the processor, build the outputs of finished and ignored
groups, free finished groups, forget finished ids.
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from vllm.config import CacheConfig, SchedulerConfig, SpecialKwargs
from vllm.core.sequence_hook_scheduler import SequenceHookScheduler
from vllm.engine.output_processor.interfaces import (
    SequenceGroupOutputProcessor)
from vllm.engine.output_processor.stop_checker import StopChecker
from vllm.inputs import token_inputs
from vllm.outputs import RequestOutput, RequestOutputFactory
from vllm.sampling_params import SamplingParams
from vllm.sequence import (CompletionSequenceGroupOutput, Logprob, Sequence,
                           SequenceGroup, SequenceGroupBase, SequenceOutput)
from vllm.transformers_utils.detokenizer import Detokenizer
from vllm.transformers_utils.tokenizer_group import TokenizerGroup
from vllm.utils import Counter


@dataclass
class Scheduled:
    """One group's part of a step, as the scheduler handed it out."""
    # The group's request id.
    request_id: str
    # Tokens computed for it this step.
    num_tokens: int
    # Whether it ran as a prefill (chunk).
    is_prompt: bool


class HookHarness:
    """A model-free engine loop around the real hook machinery.

    Args:
        tokenizer_path: Folder of the tiny tokenizer.
        special_kwargs: The hooks configuration.
        block_size: KV block size in tokens.
        num_gpu_blocks: KV blocks in the pool.
        max_model_len: Longest sequence.
        max_num_seqs: Most sequences running at once.
        policy: The scheduling policy, "fcfs" or "priority".
        enable_prefix_caching: Whether the block manager caches prefixes.
    """

    def __init__(self,
                 tokenizer_path: Path,
                 special_kwargs: SpecialKwargs,
                 block_size: int = 4,
                 num_gpu_blocks: int = 64,
                 max_model_len: int = 128,
                 max_num_seqs: int = 32,
                 policy: str = "fcfs",
                 enable_prefix_caching: bool = False):
        scheduler_config = SchedulerConfig("generate",
                                           max_num_batched_tokens=256,
                                           max_num_seqs=max_num_seqs,
                                           max_model_len=max_model_len,
                                           enable_chunked_prefill=True,
                                           policy=policy)
        cache_config = CacheConfig(block_size,
                                   1.0,
                                   1,
                                   "auto",
                                   enable_prefix_caching=enable_prefix_caching)
        cache_config.num_cpu_blocks = 8
        cache_config.num_gpu_blocks = num_gpu_blocks
        self.scheduler = SequenceHookScheduler(scheduler_config, cache_config,
                                               None)
        tokenizer_group = TokenizerGroup(str(tokenizer_path),
                                         enable_lora=False,
                                         max_num_seqs=32,
                                         max_input_length=None)
        self.tokenizer = tokenizer_group.tokenizer
        self.seq_id_to_seq_group: dict[str, SequenceGroupBase] = {}
        self.seq_counter = Counter()
        self.processor = SequenceGroupOutputProcessor.create_output_processor(
            scheduler_config,
            Detokenizer(tokenizer_group), [self.scheduler],
            self.seq_counter,
            lambda seq: self.tokenizer,
            StopChecker(max_model_len, lambda seq: self.tokenizer),
            special_kwargs=special_kwargs,
            seq_id_to_seq_group=self.seq_id_to_seq_group)
        self.block_size = block_size
        # The scheduler's outputs of the latest step.
        self.last_outputs = None
        # Outputs of finished requests, as the engine would return them.
        self.finished_outputs: list[RequestOutput] = []
        # Request ids of every output made: children's must never be here.
        self.output_request_ids: set[str] = set()

    def add(self,
            request_id: str,
            prompt: str,
            params: SamplingParams,
            priority: int = 0,
            arrival_time: Optional[float] = None) -> SequenceGroup:
        """Adds a request, as `LLMEngine.add_request` would (arrival time
        now unless given)."""
        prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        seq = Sequence(next(self.seq_counter),
                       token_inputs(prompt_token_ids=prompt_ids,
                                    prompt=prompt),
                       self.block_size,
                       eos_token_id=self.tokenizer.eos_token_id)
        group = SequenceGroup(request_id, [seq],
                              arrival_time or time.time(),
                              params,
                              priority=priority)
        self.scheduler.add_seq_group(group)
        return group

    def step(
        self,
        sampled: Optional[dict[str, int]] = None,
        default_token: Optional[int] = None,
        choose: Optional[Callable[[SequenceGroup], int]] = None
    ) -> list[Scheduled]:
        """Runs one engine step.

        Args:
            sampled: Token each request id samples this step; others sample
                ``default_token`` (the id of "the" if None).
            default_token: Token for requests not in ``sampled``.
            choose: If given, picks every group's token instead.

        Returns:
            What the scheduler handed out this step, in its order.
        """
        sampled = sampled or {}
        if default_token is None:
            default_token = self.tokenizer.convert_tokens_to_ids("the")
        for request_id in self.scheduler.get_and_reset_finished_requests_ids():
            self.seq_id_to_seq_group.pop(request_id, None)
        metadata_list, outputs, _ = self.scheduler.schedule()
        self.last_outputs = outputs
        scheduled, processed = [], []
        for metadata, item in zip(metadata_list, outputs.scheduled_seq_groups):
            group = item.seq_group
            if group.is_finished():
                # Aborted earlier in this step: the engine skips it.
                continue
            scheduled.append(
                Scheduled(group.request_id, item.token_chunk_size,
                          metadata.is_prompt))
            group.update_num_computed_tokens(item.token_chunk_size)
            token = (choose(group) if choose else sampled.get(
                group.request_id, default_token))
            sample = SequenceOutput(group.first_seq.seq_id, token,
                                    {token: Logprob(0.0)})
            output = [CompletionSequenceGroupOutput([sample], None)]
            self.processor.process_prompt_logprob(group, output)
            if metadata.do_sample:
                self.processor.process_outputs(group, output, is_async=False)
            if group.is_finished():
                self._make_output(group)
            else:
                processed.append(group)
        # Then, as the engine does, outputs of the other processed groups
        # (some may have been finished meanwhile) and of ignored ones.
        for group in processed + list(outputs.ignored_seq_groups):
            self._make_output(group)
        self.scheduler.free_finished_seq_groups()
        self.assert_parked_groups_wait_for_children()
        return scheduled

    def assert_parked_groups_wait_for_children(self) -> None:
        """Every parked group has an unfinished child: a child's finish
        unparks its parent once none is left. So parked groups never need
        counting as unfinished work of their own."""
        for request_id, group in self.scheduler.parked.items():
            node = group.first_seq.promise_tree.tree.nodes[request_id]
            assert any(not child.is_finished
                       for child in node.unmerged_children()), request_id
        assert not self.scheduler.parked or (
            self.scheduler.has_unfinished_seqs())

    def _make_output(self, group: SequenceGroup) -> None:
        """Builds a group's output as the engine does."""
        output = RequestOutputFactory.create(group, self.seq_id_to_seq_group)
        if output is not None:
            self.output_request_ids.add(output.request_id)
            if output.finished:
                self.finished_outputs.append(output)

    def free_blocks(self) -> int:
        return self.scheduler.block_manager.get_num_free_gpu_blocks()

    def block_ids(self, group: SequenceGroup) -> list[int]:
        """The KV block ids of the group's sequence."""
        return self.scheduler.block_manager.get_block_table(group.first_seq)

    def live_group(self, request_id: str) -> SequenceGroup:
        """A live group by request id, child or not."""
        for queue in (self.scheduler.running, self.scheduler.waiting):
            for group in queue:
                if group.request_id == request_id:
                    return group
        return self.scheduler.parked[request_id]


def make_harness(path: Path,
                 ids,
                 harness_options: Optional[dict] = None,
                 **hook_options) -> HookHarness:
    """A harness over the tiny tokenizer with the hooks on.

    Args:
        path: Folder of the tiny tokenizer.
        ids: Its `HookIds`.
        harness_options: `HookHarness` arguments (cache size, lengths).
        hook_options: Further `SpecialKwargs` fields.
    """
    return HookHarness(
        path,
        SpecialKwargs(sync_token_id=ids.sync,
                      promise_token_id=ids.promise,
                      **hook_options), **(harness_options or {}))
