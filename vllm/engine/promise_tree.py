# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The V0 engine's mechanics of the promise/sync lifecycle.

Every decision (limits, child ids, seeds, merges, aborts, what users see)
is made by the engine-neutral `sequence_hooks.lifecycle.Coordinator`.
`V0PromiseAdapter` feeds it the V0 engine's events (a sampled hook token, a
finished, ignored or aborted group) and carries out its actions on V0
objects: a child is a forked `Sequence` in a `SequenceGroup` of its own that
shares its parent's blocks, a park is the scheduler's `BLOCKED` status, a
resume appends the merged tokens and prefills them as one chunk.
`PromiseTreeGroup` is a tree's registry entry in the engine.
"""

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

from sequence_hooks.actions import (MERGED_TOKEN_LOGPROB, Abort, Action, Fork,
                                    MemberResult, Park, ReportTree,
                                    RequestParams, Resume, StartTree)
from sequence_hooks.lifecycle import Coordinator
from sequence_hooks.metrics import SequenceHookMetrics
from sequence_hooks.ordering import CriticalPathOrder, eviction_order
from sequence_hooks.special_kwargs import SpecialKwargs
from sequence_hooks.texts import TokenizerTexts
from sequence_hooks.tree import LiveTree, PromiseNode
from vllm.core.scheduler import SchedulerOutputs
from vllm.core.sequence_hook_scheduler import SequenceHookScheduler
from vllm.sampling_params import SamplingParams
from vllm.sequence import (Logprob, Sequence, SequenceGroup, SequenceGroupBase,
                           SequenceStatus)
from vllm.transformers_utils.detokenizer import Detokenizer
from vllm.utils import Counter


@dataclass
class PromiseTreeGroup(SequenceGroupBase):
    """One request's promise tree, registered in the engine.

    Registered in `LLMEngine.seq_id_to_seq_group` under each child's request
    id with `group_id` set to the request's id, which is vLLM's own mechanism
    (as for parallel sampling) to make aborting the request abort its
    children and to keep children from producing outputs of their own. It
    lives as long as its request's sequences refer to it.
    """

    # The tree's live record (the coordinator's; outputs snapshot it).
    tree: Optional[LiveTree] = None
    # The engine's `seq_id_to_seq_group`, which holds the children's entries.
    registry: Dict[str, SequenceGroupBase] = field(default_factory=dict,
                                                   repr=False)

    def __deepcopy__(self, memo) -> "PromiseTreeGroup":
        # Engine state that every sequence of the tree refers to: forking a
        # sequence (a deep copy) shares it.
        return self

    def snapshot(self) -> PromiseNode:
        """The tree as it is now, for the root's output."""
        return self.tree.snapshot()

    def maybe_assemble_group(
            self, seq_group: SequenceGroup) -> Optional[SequenceGroup]:
        # Children report through their parent's output only.
        return None

    def finish_seq(self, seq_group: SequenceGroup) -> None:
        # Called once the finished child's (absent) output was made: its
        # entry is not needed any more.
        self.registry.pop(seq_group.request_id, None)
        # Tracing reads it; from_seq_group sets it only for groups that
        # produce an output.
        seq_group.set_finished_time(time.time())


@dataclass
class _Fork:
    """Where a child's own output starts in its (forked) sequence."""

    # Output tokens and output text length of its context.
    output_len: int
    text_len: int


class V0PromiseAdapter:
    """The V0 engine's side of the promise/sync lifecycle.

    Created once per engine by the hook output processor and attached to
    the scheduler (`SequenceHookScheduler.attach_hooks`): the processor
    hands it each processed group (`processed`), the scheduler what it
    scheduled, ignored and aborted.

    Args:
        special_kwargs: The hook configuration, resolved to ids.
        max_model_len: The engine's longest sequence.
        scheduler: The engine's one hook scheduler.
        detokenizer: The engine's detokenizer (merges tokenize texts).
        seq_counter: The engine's sequence id counter.
        registry: The engine's `seq_id_to_seq_group`.
        metrics: The hook metrics of this engine.
    """

    def __init__(self, special_kwargs: SpecialKwargs, max_model_len: int,
                 scheduler: SequenceHookScheduler, detokenizer: Detokenizer,
                 seq_counter: Counter, registry: Dict[str, SequenceGroupBase],
                 metrics: SequenceHookMetrics):
        self.special_kwargs = special_kwargs
        self.scheduler = scheduler
        self.detokenizer = detokenizer
        self.seq_counter = seq_counter
        self.registry = registry
        self.metrics = metrics
        # A resume that prefills re-creates the generator from the seed.
        self.coordinator = Coordinator.for_format(
            special_kwargs,
            max_model_len,
            detokenizer.tokenizer_group.get_lora_tokenizer(None),
            clock=time.monotonic,
            reseeds_on_resume=True)
        # The order the scheduler gives its queues: upstream's
        # chunked-prefill scheduler ignores the priority policy, so under
        # it the queues are ordered every step.
        self.order = CriticalPathOrder.for_scheduler(
            self.coordinator,
            special_kwargs,
            scheduler.scheduler_config.policy,
            engine_orders_by_priority=False)
        # Live groups of promise trees, by request id.
        self.groups: Dict[str, SequenceGroup] = {}
        # Where each live child's own output starts.
        self._forks: Dict[str, _Fork] = {}

    # Engine events.

    def processed(self, seq_group: SequenceGroup) -> None:
        """Dispatches a group's step after stock output processing: its
        finish, or the hook token it sampled."""
        seq = seq_group.first_seq
        if seq.is_finished():
            if seq.promise_tree is not None:
                self.finished(seq_group)
            return
        params = seq_group.sampling_params
        actions = self.coordinator.sampled(
            seq_group.request_id, seq.get_token_ids(),
            lambda: RequestParams.of(
                seq.get_prompt_len(), params.max_tokens, params,
                TokenizerTexts(self.detokenizer.get_tokenizer_for_seq(seq))))
        if actions:
            # Most tokens are no event: no call on the hot path.
            self._carry_out(actions, seq_group)

    def step_scheduled(self, outputs: SchedulerOutputs) -> None:
        """Records the groups of a tree that the scheduler finished itself
        (too long for the cache): no output processing sees them, and
        nothing of this step is processed yet."""
        for seq_group in outputs.ignored_seq_groups:
            if seq_group.first_seq.promise_tree is not None:
                self.finished(seq_group, processing=False)

    def aborted(self, seq_group: SequenceGroup) -> None:
        """A group of a tree that an abort from outside finished
        (engine-level aborts bypass output processing)."""
        self._forget(seq_group)
        self._carry_out(self.coordinator.aborted(seq_group.request_id), None)
        self.metrics.export(self.coordinator.counts)

    def eviction_order(self, evicted: Set[str],
                       seq_group: SequenceGroup) -> List[str]:
        """Parked groups holding blocks, in the order to evict them for
        ``seq_group`` (`sequence_hooks.ordering.eviction_order`).

        Args:
            evicted: Parked groups whose blocks are freed already.
            seq_group: The group that needs the blocks.

        Returns:
            Request ids, the first to evict first.
        """
        return eviction_order(self.coordinator.parked_members(), evicted,
                              self.coordinator.ancestors(seq_group.request_id))

    def export_metrics(self, kv_fraction: float) -> None:
        """Exports the hook metrics: the lifecycle's counts, and the
        fraction of KV blocks in use, parked ones included."""
        self.metrics.export(self.coordinator.counts)
        self.metrics.kv_cache_usage.set(kv_fraction)

    def finished(self,
                 seq_group: SequenceGroup,
                 processing: bool = True) -> None:
        """Records a finished (stopped, capped or ignored) group of a tree.

        Args:
            seq_group: The group.
            processing: Whether the engine is processing its output now
                (False: the scheduler ignored it).
        """
        seq = seq_group.first_seq
        request_id = seq_group.request_id
        fork = self._forks.pop(request_id, _Fork(0, 0))
        params = seq_group.sampling_params
        result = MemberResult(
            token_ids=list(seq.get_output_token_ids()[fork.output_len:]),
            text=(seq.output_text[fork.text_len:]
                  if params.detokenize else None),
            logprobs=(list(seq.output_logprobs[fork.output_len:])
                      if params.logprobs is not None else None))
        actions = self.coordinator.finished(
            request_id, SequenceStatus.get_finished_reason(seq.status), result)
        self.groups.pop(request_id, None)
        self._carry_out(actions, seq_group if processing else None)

    # The coordinator's actions, carried out.

    def _carry_out(self, actions: List[Action],
                   current: Optional[SequenceGroup]) -> None:
        """Carries out the coordinator's actions, in order.

        Args:
            actions: What the coordinator returned.
            current: The group whose output the engine is processing (its
                event's); None: none (an ignored group, an abort).
        """
        for action in actions:
            if isinstance(action, StartTree):
                self._start_tree(action, current)
            elif isinstance(action, Fork):
                self._fork(action)
            elif isinstance(action, Park):
                self.scheduler.park(self.groups[action.member_id])
            elif isinstance(action, Resume):
                self._resume(action)
            elif isinstance(action, Abort):
                self._abort(action, current)
            else:
                # Outputs read the tree from the root's sequence (its
                # `promise_tree`), whenever the engine makes them.
                assert isinstance(action, ReportTree)

    def _start_tree(self, action: StartTree, current: SequenceGroup) -> None:
        # A root's first promise: the group being processed.
        assert current.request_id == action.root_id
        self.groups[action.root_id] = current
        # A request split by parallel sampling reports under its own id.
        split = self.registry.get(action.root_id)
        current.first_seq.promise_tree = PromiseTreeGroup(
            group_id=split.group_id if split else action.root_id,
            tree=action.tree,
            registry=self.registry)

    def _fork(self, child: Fork) -> None:
        parent_group = self.groups[child.parent_id]
        parent_seq = parent_group.first_seq
        # The fork shares the parent's tree (PromiseTreeGroup.__deepcopy__).
        child_seq = parent_seq.fork(next(self.seq_counter))
        params = parent_group.sampling_params.clone()
        # Its first chunk prefills output tokens, not prompt tokens.
        params.prompt_logprobs = None
        params.seed = child.seed
        # A child is part of its request, not a new one: it keeps the
        # root's arrival time and priority (the parent's are the root's).
        child_group = SequenceGroup(
            request_id=child.request_id,
            seqs=[child_seq],
            arrival_time=parent_group.arrival_time,
            sampling_params=params,
            lora_request=parent_group.lora_request,
            trace_headers=parent_group.trace_headers,
            prompt_adapter_request=parent_group.prompt_adapter_request,
            priority=parent_group.priority)
        self.scheduler.admit_child(parent_seq, child_group)
        self._append_given_tokens(child_seq, params,
                                  list(child.context_tokens))
        if child.seed is not None:
            # Only a prefill creates the child's own generator.
            self.scheduler.prefill_tail(child_seq)
        # The sequence's output holds its context's: budgets count from
        # the child's first own token.
        fork = _Fork(child_seq.get_output_len(), len(child_seq.output_text))
        if child.max_tokens is not None:
            params.max_tokens = child.max_tokens + fork.output_len
        params.min_tokens = child.min_tokens + fork.output_len
        self._forks[child.request_id] = fork
        self.groups[child.request_id] = child_group
        self.registry[child.request_id] = parent_seq.promise_tree

    def _resume(self, resume: Resume) -> None:
        seq_group = self.groups[resume.member_id]
        seq = seq_group.first_seq
        params = seq_group.sampling_params
        # The resume prefills output tokens; the prompt's logprobs are done.
        params.prompt_logprobs = None
        if resume.seed is not None:
            params.seed = resume.seed
        self._append_given_tokens(seq, params, list(resume.token_ids),
                                  resume.token_logprob)
        if seq.status == SequenceStatus.BLOCKED:
            self.scheduler.unpark(seq_group)

    def _abort(self, action: Abort, current: Optional[SequenceGroup]) -> None:
        for member_id in action.member_ids:
            seq_group = self.groups.get(member_id)
            if seq_group is None or seq_group.is_finished():
                # Finished already: its finish is void.
                continue
            processed = self.scheduler.processed_before(seq_group, current)
            # Aborted by its own id: stock abort resolves registered ids to
            # the request's, so the registry is left out.
            for seq_group in self.scheduler.abort_tree_groups(member_id):
                self._forget(seq_group)
            if not processed:
                # The engine makes no output for it this step (it skips it
                # as finished, or did not schedule it), so no output needs
                # its entry. One processed earlier in this step still gets
                # an output made, which the entry keeps empty; making it
                # drops the entry (PromiseTreeGroup.finish_seq).
                self.registry.pop(member_id, None)

    # Mechanics.

    def _forget(self, seq_group: SequenceGroup) -> None:
        """Drops an aborted group of a tree; no output is made for it."""
        self.groups.pop(seq_group.request_id, None)
        self._forks.pop(seq_group.request_id, None)
        # Tracing reads it, as `PromiseTreeGroup.finish_seq` sets it.
        seq_group.set_finished_time(time.time())

    def _append_given_tokens(self,
                             seq: Sequence,
                             params: SamplingParams,
                             token_ids: List[int],
                             logprob: float = MERGED_TOKEN_LOGPROB) -> None:
        """Appends tokens that were not sampled, to be prefilled next step.

        The detokenizer decodes only a sequence's newest token, so each
        token is decoded as it is appended.
        """
        for token_id in token_ids:
            seq.append_token_id(token_id, {token_id: Logprob(logprob)})
            if params.detokenize:
                self.detokenizer.decode_sequence_inplace(seq, params)
        if token_ids:
            self.scheduler.prefill_tail(seq)
