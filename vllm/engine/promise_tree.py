# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Promise trees in the V0 engine, and the one object that changes them.

`PromiseTreeCoordinator` owns every transition of a child sequence's life:
spawn, park and wake its parent, merge, finish, abort, registry cleanup.
The output processor tells it which hook token a sequence sampled; the
scheduler tells it what it scheduled, ignored and aborted, and asks it which
groups are on a request's critical path. It acts on the scheduler only
through its parking API.
"""

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional

from sequence_hooks.metrics import SequenceHookMetrics
from sequence_hooks.special_kwargs import SpecialKwargs
from sequence_hooks.tree import (PromiseTreeState, TreeNode, derive_seed,
                                 merged_text, without_hook_tokens)
from vllm.logger import init_logger
from vllm.sequence import (Logprob, Sequence, SequenceGroup, SequenceGroupBase,
                           SequenceStatus)
from vllm.transformers_utils.detokenizer import Detokenizer
from vllm.utils import Counter

if TYPE_CHECKING:
    from vllm.core.scheduler import SchedulerOutputs
    from vllm.core.sequence_hook_scheduler import SequenceHookScheduler

logger = init_logger(__name__)

# Log probability recorded for merged tokens: they are given, not sampled,
# so they leave the cumulative log probability unchanged.
MERGED_TOKEN_LOGPROB = 0.0


@dataclass
class PromiseTree(SequenceGroupBase, PromiseTreeState):
    """One request's promise tree, registered in the engine.

    Registered in `LLMEngine.seq_id_to_seq_group` under each child's request
    id with `group_id` set to the request's id, which is vLLM's own mechanism
    (as for parallel sampling) to make aborting the request abort its
    children and to keep children from producing outputs of their own. It
    lives as long as its request's sequence groups refer to it.
    """

    # The engine's `seq_id_to_seq_group`, which holds the children's entries.
    registry: Dict[str, SequenceGroupBase] = field(default_factory=dict,
                                                   repr=False)
    # Live (unfinished) sequence groups of the tree, by request id.
    seq_groups: Dict[str, SequenceGroup] = field(default_factory=dict,
                                                 repr=False)

    def __deepcopy__(self, memo) -> "PromiseTree":
        # Engine state that every sequence of the tree refers to: forking a
        # sequence (a deep copy) shares it.
        return self

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


class PromiseTreeCoordinator:
    """Owns the life of every child sequence of one engine.

    Created once per engine by the hook output processor and handed to the
    scheduler (`SequenceHookScheduler.attach_coordinator`).

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
                 scheduler: "SequenceHookScheduler", detokenizer: Detokenizer,
                 seq_counter: Counter, registry: Dict[str, SequenceGroupBase],
                 metrics: SequenceHookMetrics):
        self.special_kwargs = special_kwargs
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.detokenizer = detokenizer
        self.seq_counter = seq_counter
        self.registry = registry
        self.metrics = metrics
        self.hook_token_ids = special_kwargs.hook_token_ids
        # The groups the scheduler handed out this step, in the order the
        # engine processes them.
        self._scheduled: List = []

    # Called by the output processor, for the token a sequence sampled.

    def promise(self, seq_group: SequenceGroup) -> None:
        """Spawns a child of ``seq_group``'s sequence, unless a limit says no.

        Args:
            seq_group: A running group whose sequence sampled `<promise>`.
        """
        tree = self._tree_of(seq_group)
        node = tree.nodes[seq_group.request_id]
        if not tree.may_spawn(node, self.special_kwargs):
            self.metrics.promises_refused.inc()
            logger.debug("request %s: promise refused by a limit",
                         tree.group_id)
            return
        parent_seq = seq_group.first_seq
        fork_position = parent_seq.get_output_len() - node.fork_output_len
        # The fork shares the parent's tree (PromiseTree.__deepcopy__).
        child_seq = parent_seq.fork(next(self.seq_counter))
        child_id = f"{tree.group_id}/promise-{child_seq.seq_id}"
        params = seq_group.sampling_params.clone()
        # Its first chunk prefills output tokens, not prompt tokens.
        params.prompt_logprobs = None
        if params.seed is not None:
            params.seed = derive_seed(params.seed,
                                      f"child-{len(node.children)}")
        # A child is part of its request, not a new one: it keeps the
        # root's arrival time and priority (the parent's are the root's).
        child_group = SequenceGroup(
            request_id=child_id,
            seqs=[child_seq],
            arrival_time=seq_group.arrival_time,
            sampling_params=params,
            lora_request=seq_group.lora_request,
            trace_headers=seq_group.trace_headers,
            prompt_adapter_request=seq_group.prompt_adapter_request,
            priority=seq_group.priority)
        self.scheduler.add_child(parent_seq, child_group)
        role_marker = self.special_kwargs.child_role_token_id
        self._append_given_tokens(child_seq, params,
                                  [] if role_marker is None else [role_marker])
        if params.seed is not None:
            # Only a prefill creates the child's own generator.
            self.scheduler.prefill_tail(child_seq)
        # The child's own token budget starts at its fork point; the
        # parent's params are already shifted by the parent's own one.
        fork_output_len = child_seq.get_output_len()
        shift = fork_output_len - node.fork_output_len
        if params.max_tokens is not None:
            params.max_tokens += shift
        params.min_tokens += shift
        tree.add_child(node, child_id, fork_position, fork_output_len,
                       len(child_seq.output_text),
                       child_seq.get_cumulative_logprob())
        tree.seq_groups[child_id] = child_group
        self.registry[child_id] = tree
        self.metrics.promises_spawned.inc()
        self.metrics.children_running.inc()

    def sync(self, seq_group: SequenceGroup) -> None:
        """Joins the unmerged children of ``seq_group``'s sequence.

        Merges at once if they have all finished, else parks the group until
        the last one does. A sequence with no such children goes on.

        Args:
            seq_group: A running group whose sequence sampled `<sync>`.
        """
        tree = seq_group.first_seq.promise_tree
        if tree is None:
            return
        node = tree.nodes[seq_group.request_id]
        pending = node.unmerged_children()
        if not pending:
            return
        if all(child.is_finished for child in pending):
            self._merge(seq_group, tree, node)
        else:
            self.scheduler.block(seq_group)
            node.blocked_since = time.monotonic()
            self.metrics.syncs_blocked.inc()
            self.metrics.parents_parked.inc()

    def finished(self, seq_group: SequenceGroup) -> None:
        """Records a finished sequence of a tree and wakes its parent.

        Its unfinished descendants are aborted; a child's result (its own
        tokens and text) is recorded for its parent's merge.

        Args:
            seq_group: A group of a promise tree whose sequence finished
                (stopped, capped or ignored by the scheduler).
        """
        tree = seq_group.first_seq.promise_tree
        node = tree.nodes[seq_group.request_id]
        self._abort_descendants(tree, node, seq_group)
        del tree.seq_groups[node.request_id]
        self._record_result(tree, node, seq_group)
        if node.parent is None:
            return
        self.metrics.children_running.dec()
        parent_group = tree.seq_groups.get(node.parent.request_id)
        if parent_group is None:
            # The scheduler ignored parent and child in the same step, and
            # the parent was recorded first.
            return
        if (parent_group.first_seq.status == SequenceStatus.BLOCKED
                and all(child.is_finished
                        for child in node.parent.unmerged_children())):
            self._merge(parent_group, tree, node.parent)
            self.scheduler.unblock(parent_group)
            self._unparked(node.parent)

    # Called by the scheduler.

    def step_scheduled(self, outputs: "SchedulerOutputs") -> None:
        """Takes note of what the scheduler handed out for this step.

        The engine processes the scheduled groups in this order, so a group
        before the one being processed has been processed already. Groups of
        a tree that the scheduler finished itself (too long for the cache)
        are recorded as finished here: no output processing sees them.

        Args:
            outputs: The scheduler's outputs of the step it just scheduled.
        """
        # Nothing of this step is processed while ignored groups finish.
        self._scheduled = []
        for seq_group in outputs.ignored_seq_groups:
            if seq_group.first_seq.promise_tree is not None:
                self.finished(seq_group)
        self._scheduled = outputs.scheduled_seq_groups

    def aborted(self, seq_group: SequenceGroup) -> None:
        """Records a group of a tree that an abort finished, whoever asked.

        Args:
            seq_group: The aborted group (engine-level aborts bypass output
                processing, so the scheduler reports them).
        """
        tree = seq_group.first_seq.promise_tree
        node = tree.nodes[seq_group.request_id]
        del tree.seq_groups[node.request_id]
        tree.record_abort(node)
        if node.blocked_since is not None:
            self._unparked(node)
        # Tracing reads it; no output is made for an aborted child.
        seq_group.set_finished_time(time.time())
        if node.parent is not None:
            self.metrics.children_running.dec()

    def on_critical_path(self, seq_group: SequenceGroup) -> bool:
        """Whether ``seq_group`` is work its request is waiting for.

        That is a child whose parent is parked (the parent resumes only when
        it finishes) or a sequence that resumed after a merge (its request
        holds a tree's worth of work done and finishes only with it).

        Args:
            seq_group: A live group in one of the scheduler's queues.

        Returns:
            True if the scheduler should put it before new requests.
        """
        tree = seq_group.first_seq.promise_tree
        if tree is None:
            return False
        node = tree.nodes.get(seq_group.request_id)
        if node is None:
            return False
        return node.num_merged > 0 or (node.parent is not None and
                                       node.parent.blocked_since is not None)

    def record_kv_usage(self, fraction: float) -> None:
        """Exports the fraction of KV blocks in use, parked ones included."""
        self.metrics.kv_cache_usage.set(fraction)

    # Transitions.

    def _tree_of(self, seq_group: SequenceGroup) -> PromiseTree:
        """Returns the group's promise tree, creating it for a root."""
        if seq_group.first_seq.promise_tree is None:
            # A request split by parallel sampling reports under its own id.
            split = self.registry.get(seq_group.request_id)
            tree = PromiseTree(
                group_id=split.group_id if split else seq_group.request_id,
                registry=self.registry,
                root=TreeNode(seq_group.request_id))
            tree.seq_groups[seq_group.request_id] = seq_group
            seq_group.first_seq.promise_tree = tree
        return seq_group.first_seq.promise_tree

    def _unparked(self, node: TreeNode) -> None:
        """Observes how long ``node`` was parked; it is parked no more."""
        self.metrics.blocked_time.observe(time.monotonic() -
                                          node.blocked_since)
        self.metrics.parents_parked.dec()
        node.blocked_since = None

    def _abort_descendants(self, tree: PromiseTree, node: TreeNode,
                           finishing: SequenceGroup) -> None:
        """Aborts ``node``'s unfinished descendants.

        Args:
            tree: The tree.
            node: The finishing sequence's node (or one of its descendants).
            finishing: The group whose finish caused the aborts.
        """
        for child in node.children:
            if (child.is_finished
                    or tree.seq_groups[child.request_id].is_finished()):
                # Finished, or ignored by the scheduler in this step and
                # about to be recorded (with its subtree) by `finished`.
                continue
            self._abort_descendants(tree, child, finishing)
            child_group = tree.seq_groups[child.request_id]
            processed = self._processed_before(child_group, finishing)
            # Aborted by its own id: stock abort resolves registered ids to
            # the request's, so the registry is left out. The scheduler
            # reports it back to `aborted`.
            self.scheduler.abort_seq_group(child.request_id)
            if not processed:
                # The engine makes no output for it this step (it skips it
                # as finished, or did not schedule it), so no output needs
                # its entry. One processed earlier in this step still gets
                # an output made, which the entry keeps empty; making it
                # drops the entry (PromiseTree.finish_seq).
                self.registry.pop(child.request_id, None)

    def _processed_before(self, seq_group: SequenceGroup,
                          finishing: SequenceGroup) -> bool:
        """Whether the engine processed ``seq_group`` earlier in this step
        than ``finishing``, which it is processing now.

        Only called for unfinished groups, and while the engine processes
        the step's outputs (or, for ignored groups, before it processes
        any): the engine goes through the scheduled groups in order.
        """
        for scheduled in self._scheduled:
            if scheduled.seq_group is finishing:
                return False
            if scheduled.seq_group is seq_group:
                return True
        return False

    def _record_result(self, tree: PromiseTree, node: TreeNode,
                       seq_group: SequenceGroup) -> None:
        """Records a finished sequence's own tokens, text and logprobs."""
        seq = seq_group.first_seq
        start = node.fork_output_len
        token_ids = list(seq.get_output_token_ids()[start:])
        logprobs = cumulative = None
        if seq_group.sampling_params.logprobs is not None:
            merged = {
                i
                for first, count in node.merged_spans
                for i in range(first, first + count)
            }
            logprobs = [
                None if i in merged else entry
                for i, entry in enumerate(seq.output_logprobs[start:])
            ]
            # Merged tokens and role markers count 0.0 (MERGED_TOKEN_LOGPROB).
            cumulative = (seq.get_cumulative_logprob() -
                          node.fork_cumulative_logprob)
        tree.record_finish(node,
                           SequenceStatus.get_finished_reason(seq.status),
                           token_ids,
                           self._result_text(seq_group, node,
                                             token_ids), logprobs, cumulative)

    def _result_text(self, seq_group: SequenceGroup, node: TreeNode,
                     token_ids: List[int]) -> str:
        """A finished child's own output text, without hook tokens."""
        seq = seq_group.first_seq
        tokenizer = self.detokenizer.get_tokenizer_for_seq(seq)
        if not seq_group.sampling_params.detokenize:
            return tokenizer.decode(
                [t for t in token_ids if t not in self.hook_token_ids],
                skip_special_tokens=True)
        return without_hook_tokens(
            seq.output_text[node.fork_text_len:],
            tokenizer.convert_ids_to_tokens(sorted(self.hook_token_ids)))

    def _merge(self, seq_group: SequenceGroup, tree: PromiseTree,
               node: TreeNode) -> None:
        """Appends the unmerged children's texts to the group's sequence.

        The merge is cut to leave room for one sampled token within
        `max_tokens` and the model length; the stop checker then finishes
        the sequence with reason "length" at that token.
        """
        children = tree.take_unmerged(node)
        seq = seq_group.first_seq
        params = seq_group.sampling_params
        text = merged_text(children, self.special_kwargs.merge_separator)
        tokenizer = self.detokenizer.get_tokenizer_for_seq(seq)
        # Text that spells a special token stays text, never a control token.
        token_ids = tokenizer.encode(text,
                                     add_special_tokens=False,
                                     split_special_tokens=True)
        room = self.max_model_len - seq.get_len() - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - seq.get_output_len() - 1)
        token_ids = token_ids[:max(room, 0)]
        # The resume prefills output tokens; the prompt's logprobs are done.
        params.prompt_logprobs = None
        # A resume that prefills (merged tokens, or a parent evicted while
        # parked) re-creates the generator: give it a fresh seed.
        if params.seed is not None and (token_ids or seq.is_prefill()):
            params.seed = derive_seed(params.seed, f"resume-{node.num_merged}")
        start = seq.get_output_len() - node.fork_output_len
        self._append_given_tokens(seq, params, token_ids)
        tree.record_merged_tokens(node, start, len(token_ids))
        self.metrics.merged_tokens.inc(len(token_ids))

    def _append_given_tokens(self, seq: Sequence, params,
                             token_ids: List[int]) -> None:
        """Appends tokens that were not sampled, to be prefilled next step.

        The detokenizer decodes only a sequence's newest token, so each
        token is decoded as it is appended.
        """
        for token_id in token_ids:
            seq.append_token_id(token_id,
                                {token_id: Logprob(MERGED_TOKEN_LOGPROB)})
            if params.detokenize:
                self.detokenizer.decode_sequence_inplace(seq, params)
        if token_ids:
            self.scheduler.prefill_tail(seq)
