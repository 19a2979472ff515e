# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sequence hooks: `<promise>` spawns a child, `<sync>` joins the children."""

from typing import Dict, List

from sequence_hooks.metrics import SequenceHookMetrics
from sequence_hooks.special_kwargs import SpecialKwargs
from vllm.config import SchedulerConfig
from vllm.core.scheduler import Scheduler
from vllm.core.sequence_hook_scheduler import SequenceHookScheduler
from vllm.engine.output_processor.single_step import SingleStepOutputProcessor
from vllm.engine.output_processor.stop_checker import StopChecker
from vllm.engine.promise_tree import V0PromiseAdapter
from vllm.sequence import SequenceGroup, SequenceGroupBase, SequenceGroupOutput
from vllm.transformers_utils.detokenizer import Detokenizer
from vllm.utils import Counter


class SequenceHookOutputProcessor(SingleStepOutputProcessor):
    """Single-step output processor that runs sequence hooks.

    Each sampled token first goes through the stock processing (append,
    detokenize, stop check). Then the group goes to the engine's
    `V0PromiseAdapter`, whose engine-neutral `Coordinator`
    (`sequence_hooks.lifecycle`) decides what follows:

    - `<promise>` spawns a child sequence group whose sequence is a fork of
      this one: same context, same KV blocks (copy-on-write), so nothing is
      recomputed; it runs in the same batches as everything else.
    - `<sync>` with unmerged children parks the sequence in the scheduler as
      `SequenceStatus.BLOCKED` until they have all finished, or merges at
      once if they have. With no such children it is an ordinary token.
    - A sequence of a promise tree that finished is recorded (a child's
      result wakes its parent) and aborts its unfinished descendants.
    """

    def __init__(self,
                 scheduler_config: SchedulerConfig,
                 detokenizer: Detokenizer,
                 scheduler: List[Scheduler],
                 seq_counter: Counter,
                 stop_checker: StopChecker,
                 special_kwargs: SpecialKwargs,
                 seq_id_to_seq_group: Dict[str, SequenceGroupBase],
                 served_model_name: str = ""):
        super().__init__(scheduler_config, detokenizer, scheduler, seq_counter,
                         stop_checker)
        if len(scheduler) != 1 or not isinstance(scheduler[0],
                                                 SequenceHookScheduler):
            raise ValueError("sequence hooks need exactly one "
                             "SequenceHookScheduler (no pipeline parallelism)")
        if detokenizer is None:
            raise ValueError("sequence hooks need the tokenizer to merge "
                             "children's texts (skip_tokenizer_init=False)")
        self.hooks = V0PromiseAdapter(special_kwargs,
                                      scheduler_config.max_model_len,
                                      scheduler[0], detokenizer, seq_counter,
                                      seq_id_to_seq_group,
                                      SequenceHookMetrics(served_model_name))
        scheduler[0].attach_hooks(self.hooks)

    def process_outputs(self, sequence_group: SequenceGroup,
                        outputs: List[SequenceGroupOutput],
                        is_async: bool) -> None:
        """Processes the sampled token as stock vLLM does, then its hook.

        Args:
            sequence_group: The group whose token was sampled.
            outputs: Its sampler output for this step.
            is_async: Must be False: hooks need async output processing off.
        """
        super().process_outputs(sequence_group, outputs, is_async)
        self.hooks.processed(sequence_group)
