# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The output-processor factory picks the hook processor exactly when
`special_kwargs` is configured."""

import pytest

from vllm.config import CacheConfig, SchedulerConfig, SpecialKwargs
from vllm.core.scheduler import Scheduler
from vllm.core.sequence_hook_scheduler import SequenceHookScheduler
from vllm.engine.output_processor.interfaces import (
    SequenceGroupOutputProcessor)
from vllm.engine.output_processor.sequence_hook import (
    SequenceHookOutputProcessor)
from vllm.engine.output_processor.single_step import SingleStepOutputProcessor
from vllm.engine.output_processor.stop_checker import StopChecker
from vllm.transformers_utils.detokenizer import Detokenizer
from vllm.transformers_utils.tokenizer_group import TokenizerGroup
from vllm.utils import Counter


@pytest.fixture
def parts(tiny_tokenizer_path):
    scheduler_config = SchedulerConfig("generate",
                                       max_num_batched_tokens=64,
                                       max_num_seqs=4,
                                       max_model_len=64,
                                       enable_chunked_prefill=True)
    cache_config = CacheConfig(4, 1.0, 1, "auto")
    cache_config.num_cpu_blocks = cache_config.num_gpu_blocks = 8
    tokenizer_group = TokenizerGroup(str(tiny_tokenizer_path), False, 4, None)
    return scheduler_config, cache_config, Detokenizer(tokenizer_group)


def create(parts, scheduler_cls, **kwargs):
    scheduler_config, cache_config, detokenizer = parts
    scheduler = scheduler_cls(scheduler_config, cache_config, None)
    return SequenceGroupOutputProcessor.create_output_processor(
        scheduler_config, detokenizer, [scheduler], Counter(), lambda s: None,
        StopChecker(64, lambda s: None), **kwargs)


def test_no_special_kwargs_gives_the_stock_processor(parts):
    assert type(create(parts, Scheduler)) is SingleStepOutputProcessor


def test_special_kwargs_give_the_hook_processor(parts, hook_ids):
    registry: dict = {}
    processor = create(parts,
                       SequenceHookScheduler,
                       special_kwargs=SpecialKwargs(
                           sync_token_id=hook_ids.sync,
                           promise_token_id=hook_ids.promise),
                       seq_id_to_seq_group=registry)
    assert type(processor) is SequenceHookOutputProcessor
    assert isinstance(processor, SingleStepOutputProcessor)
    # One set of hooks: they register children in the engine's map, and
    # the scheduler reports to them.
    hooks = processor.hooks
    assert hooks.registry is registry
    assert hooks.scheduler.hooks is hooks


def test_hook_processor_needs_the_hook_scheduler(parts, hook_ids):
    with pytest.raises(ValueError, match="SequenceHookScheduler"):
        create(parts,
               Scheduler,
               special_kwargs=SpecialKwargs(sync_token_id=hook_ids.sync,
                                            promise_token_id=hook_ids.promise),
               seq_id_to_seq_group={})


def test_engines_pick_their_processor_and_scheduler(plain_llm, hooked_llm):
    assert type(plain_llm.llm_engine.scheduler[0]) is Scheduler
    hooked = hooked_llm.llm_engine
    assert type(hooked.output_processor) is SequenceHookOutputProcessor
    assert type(hooked.scheduler[0]) is SequenceHookScheduler
    assert hooked.output_processor.hooks.registry is (
        hooked.seq_id_to_seq_group)
