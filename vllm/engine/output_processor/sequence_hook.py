# SPDX-License-Identifier: Apache-2.0
"""Sequence hooks: `<promise>` spawns a child, `<sync>` joins the children."""

import hashlib
import time
from typing import Dict, List, Set

from vllm.config import SchedulerConfig
from vllm.core.scheduler import Scheduler
from vllm.core.sequence_hook_scheduler import SequenceHookScheduler
from vllm.engine.output_processor.promise_tree import PromiseNode, PromiseTree
from vllm.engine.output_processor.single_step import SingleStepOutputProcessor
from vllm.engine.output_processor.stop_checker import StopChecker
from vllm.engine.sequence_hook_metrics import SequenceHookMetrics
from vllm.logger import init_logger
from vllm.sequence import (Logprob, Sequence, SequenceGroup, SequenceGroupBase,
                           SequenceGroupOutput, SequenceStatus)
from vllm.special_kwargs import SpecialKwargs
from vllm.transformers_utils.detokenizer import Detokenizer
from vllm.utils import Counter

logger = init_logger(__name__)

# Log probability recorded for merged tokens: they are given, not sampled,
# so they leave the cumulative log probability unchanged.
MERGED_TOKEN_LOGPROB = 0.0


def derive_seed(seed: int, purpose: str) -> int:
    """A deterministic seed for a child or a resume of a seeded sequence.

    A prefill re-creates a seeded group's generator from its seed, so each
    child and each resume gets its own seed, derived from its parent's.
    """
    digest = hashlib.blake2b(f"{seed}:{purpose}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


class SequenceHookOutputProcessor(SingleStepOutputProcessor):
    """Single-step output processor that runs sequence hooks.

    Each sampled token first goes through the stock processing (append,
    detokenize, stop check). Then, for a sequence that is still running:

    - `<promise>` spawns a child sequence group whose sequence is a fork of
      this one: same context, same KV blocks (copy-on-write), so nothing is
      recomputed; it runs in the same batches as everything else.
    - `<sync>` with unmerged children parks the sequence in the scheduler as
      `SequenceStatus.BLOCKED` until they have all finished, or merges at
      once if they have. With no such children it is an ordinary token.

    A merge appends the children's output texts, joined by the configured
    separator and tokenized, to the parent, which resumes with a prefill of
    exactly the `<sync>` token and the merged tokens. A sequence that
    finishes aborts its unfinished descendants.
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
        self.hook_scheduler: SequenceHookScheduler = scheduler[0]
        self.hook_scheduler.finish_callback = self._finish
        self.hook_scheduler.abort_callback = self._record_abort
        self.metrics = SequenceHookMetrics(served_model_name)
        self.hook_scheduler.kv_usage_gauge = self.metrics.kv_cache_usage
        self.special_kwargs = special_kwargs
        # The engine's map of split requests; children are registered there.
        self.seq_id_to_seq_group = seq_id_to_seq_group
        self._hook_token_ids = special_kwargs.hook_token_ids
        # Request ids the engine has processed in step `_processed_step`.
        self._processed_step = -1
        self._processed_ids: Set[str] = set()

    def process_prompt_logprob(self, seq_group: SequenceGroup,
                               outputs: List[SequenceGroupOutput]) -> None:
        """Notes the group as processed this step, then as stock vLLM.

        The engine calls this first for every group it processes in a step,
        sampling or not. Only groups of a promise tree are noted: only they
        can be aborted as descendants later in the step.
        """
        if seq_group.promise_tree is not None:
            step = self.hook_scheduler.num_steps
            if step != self._processed_step:
                self._processed_step, self._processed_ids = step, set()
            self._processed_ids.add(seq_group.request_id)
        super().process_prompt_logprob(seq_group, outputs)

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
        seq = sequence_group.first_seq
        if seq.is_finished():
            if sequence_group.promise_tree is not None:
                self._finish(sequence_group)
            return
        token_id = seq.get_last_token_id()
        if token_id == self.special_kwargs.promise_token_id:
            self._promise(sequence_group)
        elif token_id == self.special_kwargs.sync_token_id:
            self._sync(sequence_group)

    def _tree_of(self, seq_group: SequenceGroup) -> PromiseTree:
        """Returns the group's promise tree, creating it for a root."""
        if seq_group.promise_tree is None:
            # A request split by parallel sampling reports under its own id.
            split = self.seq_id_to_seq_group.get(seq_group.request_id)
            tree = PromiseTree(
                group_id=split.group_id if split else seq_group.request_id,
                registry=self.seq_id_to_seq_group,
                root=PromiseNode(seq_group.request_id))
            tree.seq_groups[seq_group.request_id] = seq_group
            seq_group.promise_tree = tree
        return seq_group.promise_tree

    def _promise(self, seq_group: SequenceGroup) -> None:
        tree = self._tree_of(seq_group)
        node = tree.nodes[seq_group.request_id]
        limits = self.special_kwargs
        if (len(node.children) >= limits.max_children_per_sequence
                or tree.num_spawned >= limits.max_children_per_request
                or node.depth >= limits.max_depth):
            tree.num_refused += 1
            self.metrics.promises_refused.inc()
            logger.debug("request %s: promise refused by a limit",
                         tree.group_id)
            return
        parent_seq = seq_group.first_seq
        child_seq = parent_seq.fork(next(self.seq_counter))
        child_id = f"{tree.group_id}/promise-{child_seq.seq_id}"
        params = seq_group.sampling_params.clone()
        # Its first chunk prefills output tokens, not prompt tokens.
        params.prompt_logprobs = None
        if params.seed is not None:
            params.seed = derive_seed(params.seed,
                                      f"child-{len(node.children)}")
        child_group = SequenceGroup(
            request_id=child_id,
            seqs=[child_seq],
            arrival_time=time.time(),
            sampling_params=params,
            lora_request=seq_group.lora_request,
            trace_headers=seq_group.trace_headers,
            prompt_adapter_request=seq_group.prompt_adapter_request,
            priority=seq_group.priority)
        child_group.promise_tree = tree
        self.hook_scheduler.add_child(parent_seq, child_group)
        marker = ([] if limits.child_role_token_id is None else
                  [limits.child_role_token_id])
        self._append_given_tokens(child_seq, params, marker)
        if params.seed is not None:
            # Only a prefill creates the child's own generator.
            self.hook_scheduler.prefill_tail(child_seq)
        # The child's own token budget starts at its fork point; the
        # parent's params are already shifted by the parent's own one.
        fork_output_len = child_seq.get_output_len()
        shift = fork_output_len - node.fork_output_len
        if params.max_tokens is not None:
            params.max_tokens += shift
        params.min_tokens += shift
        child_node = PromiseNode(child_id,
                                 depth=node.depth + 1,
                                 parent=node,
                                 fork_output_len=fork_output_len,
                                 fork_text_len=len(child_seq.output_text))
        node.children.append(child_node)
        tree.nodes[child_id] = child_node
        tree.num_spawned += 1
        tree.seq_groups[child_id] = child_group
        self.metrics.promises_spawned.inc()
        self.metrics.children_running.inc()
        self.seq_id_to_seq_group[child_id] = tree

    def _sync(self, seq_group: SequenceGroup) -> None:
        tree = seq_group.promise_tree
        if tree is None:
            return
        node = tree.nodes[seq_group.request_id]
        pending = node.unmerged_children()
        if not pending:
            return
        if all(child.is_finished for child in pending):
            self._merge(seq_group, node)
        else:
            self.hook_scheduler.block(seq_group)
            node.blocked_since = time.monotonic()
            self.metrics.syncs_blocked.inc()

    def _finish(self, seq_group: SequenceGroup) -> None:
        """Records a finished sequence of a tree and wakes its parent."""
        tree = seq_group.promise_tree
        node = tree.nodes[seq_group.request_id]
        self._abort_descendants(tree, node)
        del tree.seq_groups[node.request_id]
        seq = seq_group.first_seq
        node.finish_reason = SequenceStatus.get_finished_reason(seq.status)
        if node.parent is None:
            return
        self.metrics.children_running.dec()
        node.token_ids = list(
            seq.get_output_token_ids()[node.fork_output_len:])
        node.text = self._result_text(seq, node, seq_group)
        parent_group = tree.seq_groups.get(node.parent.request_id)
        if parent_group is None:
            # The scheduler ignored parent and child in the same step, and
            # the parent was recorded first.
            return
        parent_seq = parent_group.first_seq
        if (parent_seq.status == SequenceStatus.BLOCKED
                and all(child.is_finished
                        for child in node.parent.unmerged_children())):
            self._merge(parent_group, node.parent)
            self.hook_scheduler.unblock(parent_group)
            self.metrics.blocked_time.observe(time.monotonic() -
                                              node.parent.blocked_since)

    def _abort_descendants(self, tree: PromiseTree, node: PromiseNode) -> None:
        for child in node.children:
            if (child.is_finished
                    or tree.seq_groups[child.request_id].is_finished()):
                # Finished, or ignored by the scheduler in this step and
                # about to be recorded (with its subtree) by _finish.
                continue
            self._abort_descendants(tree, child)
            # Aborted by its own id: stock abort resolves registered ids to
            # the request's, so the map is left out. The scheduler reports
            # it to _record_abort.
            self.hook_scheduler.abort_seq_group(child.request_id)
            if not (self._processed_step == self.hook_scheduler.num_steps
                    and child.request_id in self._processed_ids):
                # The engine makes no output for it this step (it skips it
                # as finished, or did not schedule it), so no output needs
                # its entry. One processed earlier in this step still gets
                # an output made, which the entry keeps empty; making it
                # drops the entry (PromiseTree.finish_seq).
                self.seq_id_to_seq_group.pop(child.request_id, None)

    def _record_abort(self, seq_group: SequenceGroup) -> None:
        """Records an aborted group of a tree, whoever aborted it."""
        tree = seq_group.promise_tree
        node = tree.nodes[seq_group.request_id]
        del tree.seq_groups[node.request_id]
        node.finish_reason = "abort"
        # Tracing reads it; no output is made for an aborted child.
        seq_group.set_finished_time(time.time())
        if node.parent is not None:
            self.metrics.children_running.dec()

    def _result_text(self, seq: Sequence, node: PromiseNode,
                     seq_group: SequenceGroup) -> str:
        """A finished child's own output text, without hook tokens."""
        tokenizer = self.detokenizer.get_tokenizer_for_seq(seq)
        if not seq_group.sampling_params.detokenize:
            return tokenizer.decode(
                [t for t in node.token_ids if t not in self._hook_token_ids],
                skip_special_tokens=True)
        # Hook tokens show in the text when they are not special tokens of
        # the tokenizer or special tokens are not skipped.
        text = seq.output_text[node.fork_text_len:]
        for token in tokenizer.convert_ids_to_tokens(
                sorted(self._hook_token_ids)):
            text = text.replace(token, "")
        return text

    def _merge(self, seq_group: SequenceGroup, node: PromiseNode) -> None:
        """Appends the unmerged children's texts to the group's sequence.

        The merge is cut to leave room for one sampled token within
        `max_tokens` and the model length; the stop checker then finishes
        the sequence with reason "length" at that token.
        """
        children = node.unmerged_children()
        node.num_merged = len(node.children)
        seq = seq_group.first_seq
        params = seq_group.sampling_params
        text = self.special_kwargs.merge_separator.join(child.text
                                                        for child in children)
        tokenizer = self.detokenizer.get_tokenizer_for_seq(seq)
        # Text that spells a special token stays text, never a control token.
        token_ids = tokenizer.encode(text,
                                     add_special_tokens=False,
                                     split_special_tokens=True)
        room = self.scheduler_config.max_model_len - seq.get_len() - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - seq.get_output_len() - 1)
        token_ids = token_ids[:max(room, 0)]
        # The resume prefills output tokens; the prompt's logprobs are done.
        params.prompt_logprobs = None
        # A resume that prefills (merged tokens, or a parent evicted while
        # parked) re-creates the generator: give it a fresh seed.
        if params.seed is not None and (token_ids or seq.is_prefill()):
            params.seed = derive_seed(params.seed, f"resume-{node.num_merged}")
        self._append_given_tokens(seq, params, token_ids)
        node.num_merged_tokens += len(token_ids)
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
            self.hook_scheduler.prefill_tail(seq)
