# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Promise/sync on vLLM's V1 engine: a scheduler subclass.

Selected with `scheduler_cls` (`--scheduler-cls`) and configured with
`additional_config={"special_kwargs": {...}}`. Every hook runs in the engine
core, after the stock `update_from_output` has appended and stop-checked the
step's sampled tokens. See docs/v1.md.
"""

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np

from sequence_hooks import SpecialKwargs
from sequence_hooks.metrics import SequenceHookMetrics
from sequence_hooks.tree import (PromiseTreeState, TokenLogprobs, TreeNode,
                                 derive_seed, merged_text, without_hook_tokens)
from vllm.config import VllmConfig
from vllm.logprobs import append_logprobs_for_next_position
from vllm.tokenizers import cached_tokenizer_from_config
from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.engine.detokenizer import IncrementalDetokenizer
from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus, StreamingUpdate

# Key of `additional_config` that holds the SpecialKwargs (dict or JSON).
CONFIG_KEY = "special_kwargs"
# Key of the root's `RequestOutput.kv_transfer_params` that carries the
# tree's snapshot (`PromiseNode.to_dict(top_logprobs=True)`): the one
# per-request dict V1 passes from the engine core to the frontend's outputs.
TREE_KEY = "promise_tree"
# Key that replaces it on a sample of an `n > 1` request: the trees of the
# request's samples finished so far, by sample index (a string, as JSON
# keys are), each as under TREE_KEY. The frontend keeps only the last
# finishing sample's `kv_transfer_params` for the request's output.
SAMPLE_TREES_KEY = "promise_trees"
# Engine request id of a sample V1's frontend fans an `n > 1` request out
# to: "<index>_<the request's id>" (`ParentRequest.get_child_info`).
SAMPLE_ID = re.compile(r"(\d+)_(.+)", re.DOTALL)
# Logprob given to a merged token in the request's logprobs (as on V0).
MERGED_TOKEN_LOGPROB = 0.0


@dataclass
class Member:
    """V1 bookkeeping of one live tree member's engine request."""

    # Where its own tokens start in its request's `all_token_ids` (a
    # child's prompt is its parent's context).
    start: int
    # Its `max_tokens` when it started: a resume turns its output into
    # prompt, which resets upstream's count.
    budget: int
    # A child's sampled tokens' logprobs so far (None where merged); None
    # unless the request asked for logprobs (the root's are its output's).
    logprobs: Optional[list[Optional[TokenLogprobs]]] = None


@dataclass
class Samples:
    """The samples of one `n > 1` request this engine core runs."""

    # Request ids of its samples that have not finished.
    live: set[str] = field(default_factory=set)
    # Finished samples' trees (`PromiseNode.to_dict`), by sample index.
    trees: dict[str, dict[str, Any]] = field(default_factory=dict)


def special_kwargs_of(vllm_config: VllmConfig) -> SpecialKwargs:
    """Reads and validates the hooks' configuration.

    Args:
        vllm_config: The engine's configuration.

    Returns:
        The SpecialKwargs in `additional_config["special_kwargs"]`.

    Raises:
        ValueError: if it is missing or invalid.
    """
    raw = (vllm_config.additional_config or {}).get(CONFIG_KEY)
    if raw is None:
        raise ValueError(f"SequenceHookScheduler needs additional_config="
                         f"{{'{CONFIG_KEY}': {{...}}}}")
    if isinstance(raw, SpecialKwargs):
        return raw
    if isinstance(raw, str):
        return SpecialKwargs.from_json(raw)
    return SpecialKwargs(**raw)


class SequenceHookScheduler(Scheduler):
    """V1 scheduler that runs promise/sync sequence hooks.

    - `<promise>` adds a child request whose prompt is the parent's whole
      context (plus the role marker). Its prefix-cache lookup is answered
      with the parent's blocks: full blocks are shared by reference count,
      the partly filled last block is copied (upstream's copy-on-write for
      partial prefix hits), so the child computes only `<promise>` and the
      marker.
    - `<sync>` with unmerged children parks the parent the way upstream
      parks a streaming-input session: it keeps its blocks and its model
      runner state, and is never scheduled. When its children have
      finished, their texts are appended as the session's next input chunk,
      so the resume computes exactly `<sync>` plus the merged tokens.
    - Children's outputs never leave the engine core; the merged tokens and,
      at the end, the tree's snapshot reach the root's output. A request
      whose outputs carry trees and that has stop strings is also
      stop-checked here, as the frontend checks it, so that it ends with
      its tree in the output the frontend stops at.

    The tree is the engine-neutral `PromiseTreeState` the V0 fork keeps.
    """

    def __init__(self, vllm_config: VllmConfig, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        if not self.kv_cache_manager.enable_caching:
            raise ValueError("sequence hooks on V1 share the parent's KV "
                             "blocks through the prefix cache: keep "
                             "enable_prefix_caching on")
        if self.use_pp:
            raise ValueError("sequence hooks do not support pipeline "
                             "parallelism")
        self.tokenizer = cached_tokenizer_from_config(vllm_config.model_config)
        special_kwargs = special_kwargs_of(vllm_config).resolve(self.tokenizer)
        special_kwargs.check_vocab_size(
            vllm_config.model_config.get_vocab_size())
        self.special_kwargs = special_kwargs
        self.hook_token_ids = special_kwargs.hook_token_ids
        self.hook_token_strings = self.tokenizer.convert_ids_to_tokens(
            sorted(self.hook_token_ids))
        # The tree of every live tree member, by the member's request id.
        self.trees: dict[str, PromiseTreeState] = {}
        # Every live tree member's engine bookkeeping, by request id.
        self.members: dict[str, Member] = {}
        # Children not yet admitted, with the parent tokens computed at the
        # fork: their prefix hit is the parent's blocks.
        self.pending_forks: dict[str, int] = {}
        # Parked parents whose KV blocks were freed under pressure: they
        # recompute their context when they resume.
        self.evicted: set[str] = set()
        # The samples of each `n > 1` request, by the request's id: each
        # sample's tree travels with every later finishing sample's output.
        self.samples: dict[str, Samples] = {}
        # The frontend's stop-string check, mirrored for each request whose
        # outputs carry trees and that has stop strings, by request id.
        self.stop_checks: dict[str, IncrementalDetokenizer] = {}
        # V0's `vllm:sequence_hook_*` metrics (docs/v1.md: how they reach
        # `/metrics` from the engine core's process).
        self.metrics = SequenceHookMetrics(
            vllm_config.model_config.served_model_name)
        # Tokens each tree member computed in each step, for the tests and
        # benchmarks: (step, request id, tokens).
        self.computed_log: Optional[list[tuple[int, str, int]]] = None

    # ----------------------------------------------------------- scheduling

    def schedule(self, *args, **kwargs) -> SchedulerOutput:
        """Schedules as upstream, parked parents not counted as running.

        Upstream counts parked streaming sessions against `max_num_seqs`;
        a parked parent holds no row of the model runner's batch (it drops
        unscheduled requests from it), and counting it could leave its own
        children waiting forever once parents fill the limit.
        """
        self._evict_parked_parents_if_stalled()
        parked = self.num_parked()
        self.num_waiting_for_streaming_input -= parked
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self.num_waiting_for_streaming_input += parked
        self.metrics.kv_cache_usage.set(self.kv_cache_manager.usage)
        if self.computed_log is not None:
            self.computed_log += [
                (self.current_step, request_id, n)
                for request_id, n in output.num_scheduled_tokens.items()
            ]
        return output

    def num_parked(self) -> int:
        """Parents parked by `<sync>`, waiting for their children."""
        return sum(tree.nodes[request_id].blocked_since is not None
                   for request_id, tree in self.trees.items())

    def _evict_parked_parents_if_stalled(self) -> None:
        """Frees parked parents' blocks while they alone block the queue.

        With nothing running, the next request to admit waits only for
        blocks; if parked parents hold them, nothing frees them (their
        children are the ones waiting), so the newest parked parents are
        evicted until it fits, as V0 does. A parent its request descends
        from goes last: its blocks are that request's prefix hit. A parent
        whose children all finished is never a victim: it is merged and
        resumed at once, parked no more.
        """
        if self.running:
            return
        admissible = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        candidate = next(
            (request for queue in (self.kv_holding_waiting, self.waiting)
             for request in queue if request.status in admissible), None)
        if candidate is None:
            return
        ancestors = self._ancestors_of(candidate.request_id)
        parked = [(tree.nodes[request_id].blocked_since, request_id)
                  for request_id, tree in self.trees.items()
                  if tree.nodes[request_id].blocked_since is not None
                  and request_id not in self.evicted]
        parked.sort(key=lambda since_and_id:
                    (since_and_id[1] in ancestors, -since_and_id[0]))
        pool = self.kv_cache_manager.block_pool
        for _, request_id in parked:
            if pool.get_num_free_blocks() >= self._blocks_to_admit(candidate):
                return
            self._evict(self.requests[request_id])

    def _ancestors_of(self, request_id: str) -> set[str]:
        """The request ids of a tree member's parent, its parent's..."""
        tree = self.trees.get(request_id)
        if tree is None:
            return set()
        node = tree.nodes[request_id].parent
        ancestors = set()
        while node is not None:
            ancestors.add(node.request_id)
            node = node.parent
        return ancestors

    def _blocks_to_admit(self, request: Request) -> int:
        """New blocks a waiting request needs for its next token: less
        those it holds (a resumed parent), or the full blocks it shares
        with a parent still holding them (a new child)."""
        needed = cdiv(request.num_tokens + 1, self.block_size)
        if self._has_blocks(request):
            return needed - cdiv(request.num_computed_tokens, self.block_size)
        num_shared = self.pending_forks.get(request.request_id)
        if num_shared is not None:
            parent_id = self.trees[request.request_id].nodes[
                request.request_id].parent.request_id
            parent = self.requests.get(parent_id)
            if parent is not None and self._has_blocks(parent):
                needed -= min(num_shared,
                              parent.num_computed_tokens) // self.block_size
        return needed

    def _has_blocks(self, request: Request) -> bool:
        """Holds KV blocks: an evicted parked parent keeps its computed
        count (its resume cuts its tokens there) but holds none."""
        return (self._holds_kv_blocks(request)
                and request.request_id not in self.evicted)

    def _evict(self, request: Request) -> None:
        """Frees a parked parent's KV blocks; its tokens stay, and its
        resume recomputes them (less what the prefix cache gives back)."""
        self.kv_cache_manager.free(request)
        self.evicted.add(request.request_id)

    def _get_local_prefix_cache_hit(self, request: Request):
        """A new child's hit is its parent's computed context."""
        num_shared = self.pending_forks.pop(request.request_id, None)
        if num_shared is not None:
            node = self.trees[request.request_id].nodes[request.request_id]
            parent = self.requests.get(node.parent.request_id)
            if parent is not None and self._has_blocks(parent):
                shared = min(num_shared, parent.num_computed_tokens)
                blocks = self.kv_cache_manager.get_blocks(
                    parent.request_id).blocks
                num_blocks = cdiv(shared, self.block_size)
                hit = self.kv_cache_manager.create_kv_cache_blocks(
                    tuple(list(group[:num_blocks]) for group in blocks))
                return hit, shared, 0, False
            # The parent lost its blocks (preempted): compute everything.
            return self.kv_cache_manager.empty_kv_cache_blocks, 0, 0, False
        return super()._get_local_prefix_cache_hit(request)

    # --------------------------------------------------------------- output

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput,
    ) -> dict[int, EngineCoreOutputs]:
        """Runs the stock update, then the hooks of the sampled tokens."""
        # Finished requests leave `self.requests` in the stock update.
        scheduled = {
            request_id: self.requests[request_id]
            for request_id in scheduler_output.num_scheduled_tokens
            if request_id in self.requests
        }
        engine_outputs = super().update_from_output(scheduler_output,
                                                    model_runner_output)
        # Outputs the hooks add (merged tokens of resumed parents).
        extra: dict[int, list[EngineCoreOutput]] = {}
        for client_index, outputs in engine_outputs.items():
            by_id = {out.request_id: out for out in outputs.outputs}
            # Decided before the hooks run: a finished root drops its tree.
            children = {
                request_id
                for request_id in by_id if self._is_child(request_id)
            }
            for out in list(outputs.outputs):
                request = scheduled.get(out.request_id)
                if request is not None:
                    self._on_output(request, out, by_id, extra)
            # Children never report to the frontend.
            outputs.outputs = [
                out for out in outputs.outputs
                if out.request_id not in children
            ]
        for client_index, outputs in extra.items():
            engine_outputs.setdefault(
                client_index, EngineCoreOutputs()).outputs.extend(outputs)
        for outputs in engine_outputs.values():
            for out in outputs.outputs:
                if out.finish_reason is None:
                    self._check_stop_strings(out)
                if out.finish_reason is not None:
                    self.stop_checks.pop(out.request_id, None)
                    self._report_sample_trees(out)
        return engine_outputs

    def _check_stop_strings(self, out: EngineCoreOutput) -> None:
        """Ends a request whose output completes a stop string, with its
        tree, if its outputs carry trees.

        The frontend checks stop strings and then aborts the request in
        the engine core, so no output of the core would carry the tree.
        Here the frontend's own incremental detokenizer is fed the same
        tokens, so the stop is found in the same output, which ends the
        request (as V0's engine does) and carries the tree.
        """
        request = self.requests.get(out.request_id)
        if (request is None or request.is_finished()
                or not request.sampling_params.stop):
            return
        check = self.stop_checks.get(out.request_id)
        if check is None:
            if not self._carries_trees(out.request_id):
                return
            check = self._new_stop_check(request, len(out.new_token_ids))
        if check.update(out.new_token_ids, False) is None:
            return
        tree = self.trees.get(out.request_id)
        if tree is not None:
            # As on V0: live children are aborted, the root stops there;
            # its tokens end where the frontend cuts them.
            self._abort(tree, tree.root.live_descendants())
            self._unpark(tree.root)
            tree.record_finish(
                tree.root, "stop", list(check.output_token_ids),
                without_hook_tokens(check.output_text,
                                    self.hook_token_strings))
            self._report_tree(tree, out)
        super().finish_requests(out.request_id, RequestStatus.FINISHED_STOPPED)
        # The frontend finds the same stop string and reports it; were it
        # not to, the request would end aborted rather than wait forever.
        out.finish_reason = FinishReason.ABORT

    def _carries_trees(self, request_id: str) -> bool:
        """Whether a request's last output must carry trees: a tree's
        root, or a sample of a request whose samples have trees."""
        if request_id in self.trees:
            return True
        samples = self._samples_of(request_id)
        return samples is not None and (bool(samples.trees)
                                        or any(sample in self.trees
                                               for sample in samples.live))

    def _new_stop_check(self, request: Request,
                        num_new: int) -> IncrementalDetokenizer:
        """The frontend's detokenizer of a request, fed its output tokens
        but the ``num_new`` last: it starts when the request's outputs
        start carrying trees."""
        member = self.members.get(request.request_id)
        start = (request.num_prompt_tokens if member is None else member.start)
        tokens = request.all_token_ids
        # What the detokenizer reads of the frontend's `EngineCoreRequest`.
        check = IncrementalDetokenizer.from_new_request(
            self.tokenizer,
            SimpleNamespace(request_id=request.request_id,
                            prompt_token_ids=list(tokens[:start]),
                            prompt_embeds=None,
                            sampling_params=request.sampling_params))
        check.update(list(tokens[start:len(tokens) - num_new]), False)
        self.stop_checks[request.request_id] = check
        return check

    def _is_child(self, request_id: str) -> bool:
        tree = self.trees.get(request_id)
        return tree is not None and tree.root.request_id != request_id

    def _on_output(self, request: Request, out: EngineCoreOutput,
                   by_id: dict[str, EngineCoreOutput],
                   extra: dict[int, list[EngineCoreOutput]]) -> None:
        if out.finish_reason is None and request.is_finished():
            # Aborted earlier in this step, with its finished ancestor.
            return
        tree = self.trees.get(request.request_id)
        node = None if tree is None else tree.nodes[request.request_id]
        if node is not None and node.is_finished:
            return
        if tree is not None and out.new_logprobs is not None:
            self._record_logprobs(request.request_id, out.new_logprobs)
        if out.finish_reason is not None:
            if node is not None:
                self._finish(request, tree, node, str(out.finish_reason),
                             by_id, extra)
            return
        if not out.new_token_ids:
            return
        token_id = out.new_token_ids[-1]
        if token_id == self.special_kwargs.promise_token_id:
            self._promise(request)
        elif token_id == self.special_kwargs.sync_token_id and node:
            self._sync(request, tree, node, by_id, extra)

    def _record_logprobs(self, request_id: str,
                         new_logprobs: LogprobsLists) -> None:
        """Keeps a child's sampled tokens' logprobs for its tree node."""
        member = self.members[request_id]
        if member.logprobs is None:
            return
        token_ids, logprobs, ranks, _ = new_logprobs
        for row_ids, row_logprobs, rank in zip(token_ids, logprobs, ranks):
            append_logprobs_for_next_position(member.logprobs,
                                              row_ids.tolist(),
                                              row_logprobs.tolist(),
                                              [None] * len(row_ids), int(rank),
                                              len(row_ids) - 1)

    # ---------------------------------------------------------------- hooks

    def _tree_of(self, request: Request) -> PromiseTreeState:
        """The request's tree, made when a root first promises."""
        tree = self.trees.get(request.request_id)
        if tree is None:
            # A resume extends the prompt in place; with the engine core in
            # process, the frontend holds the same list.
            request.prompt_token_ids = list(request.prompt_token_ids)
            tree = PromiseTreeState(root=TreeNode(request.request_id))
            self.trees[request.request_id] = tree
            self.members[request.request_id] = Member(
                start=request.num_prompt_tokens, budget=request.max_tokens)
        return tree

    def _promise(self, parent: Request) -> None:
        tree = self._tree_of(parent)
        node = tree.nodes[parent.request_id]
        if not tree.may_spawn(node, self.special_kwargs):
            self.metrics.promises_refused.inc()
            return
        limits = self.special_kwargs
        marker = ([] if limits.child_role_token_id is None else
                  [limits.child_role_token_id])
        context = list(parent.all_token_ids) + marker
        child_id = f"{tree.root.request_id}/promise-{tree.num_spawned + 1}"
        params = parent.sampling_params.clone()
        # Its prompt is the parent's context: no prompt logprobs, and its
        # own budget, counted from the fork.
        params.prompt_logprobs = None
        params.max_tokens = self.members[tree.root.request_id].budget
        if params.seed is not None:
            # A new request seeds a new generator: with the parent's seed,
            # the child would replay the parent's random stream.
            params.seed = derive_seed(params.seed,
                                      f"child-{len(node.children)}")
        child = Request(request_id=child_id,
                        prompt_token_ids=context,
                        sampling_params=params,
                        pooling_params=None,
                        client_index=parent.client_index,
                        lora_request=parent.lora_request,
                        cache_salt=parent.cache_salt,
                        priority=parent.priority,
                        block_hasher=parent._block_hasher)
        # The child request has no output yet: its own tokens, text and
        # cumulative logprob start at 0 after its context.
        tree.add_child(node,
                       child_id,
                       fork_position=(parent.num_tokens -
                                      self.members[parent.request_id].start),
                       fork_output_len=0,
                       fork_text_len=0,
                       fork_cumulative_logprob=0.0)
        self.trees[child_id] = tree
        self.members[child_id] = Member(
            start=len(context),
            budget=params.max_tokens,
            logprobs=None if params.logprobs is None else [])
        self.pending_forks[child_id] = parent.num_computed_tokens
        self.requests[child_id] = child
        self.metrics.promises_spawned.inc()
        self.metrics.children_running.inc()
        # Ahead of new requests: it continues work already admitted.
        self.waiting.prepend_request(child)

    def _sync(self, request: Request, tree: PromiseTreeState, node: TreeNode,
              by_id: dict[str, EngineCoreOutput],
              extra: dict[int, list[EngineCoreOutput]]) -> None:
        pending = node.unmerged_children()
        if not pending:
            return
        # Parked like a streaming-input session between chunks: out of the
        # running queue, blocks and model-runner state kept.
        self.running.remove(request)
        request.status = RequestStatus.WAITING_FOR_STREAMING_REQ
        self.num_waiting_for_streaming_input += 1
        self._enqueue_waiting_request(request)
        node.blocked_since = time.monotonic()
        self.metrics.syncs_blocked.inc()
        self.metrics.parents_parked.inc()
        if all(child.is_finished for child in pending):
            self._merge(request, tree, node, by_id, extra)

    def _unpark(self, node: TreeNode) -> None:
        """Observes how long ``node`` was parked; it is parked no more."""
        if node.blocked_since is not None:
            self.metrics.blocked_time.observe(time.monotonic() -
                                              node.blocked_since)
            self.metrics.parents_parked.dec()
            node.blocked_since = None

    def _finish(self, request: Request, tree: PromiseTreeState, node: TreeNode,
                reason: str, by_id: dict[str, EngineCoreOutput],
                extra: dict[int, list[EngineCoreOutput]]) -> None:
        """Records a finished tree member and wakes its parent."""
        self._abort(tree, node.live_descendants())
        member = self.members[node.request_id]
        token_ids = list(request.all_token_ids[member.start:])
        params = request.sampling_params
        logprobs = member.logprobs
        cumulative = None if logprobs is None else sum(
            entry[token].logprob for token, entry in zip(token_ids, logprobs)
            if entry is not None)
        # The text as the frontend would detokenize it, hook tokens removed.
        text = without_hook_tokens(
            self.tokenizer.decode(
                token_ids, skip_special_tokens=params.skip_special_tokens),
            self.hook_token_strings)
        tree.record_finish(node, reason, token_ids, text, logprobs, cumulative)
        if node.parent is None:
            self._report_tree(tree, by_id.get(request.request_id))
            return
        self.members.pop(node.request_id)
        self.metrics.children_running.dec()
        parent_node = node.parent
        parent = self.requests.get(parent_node.request_id)
        if (parent is not None and parent_node.blocked_since is not None
                and all(child.is_finished
                        for child in parent_node.unmerged_children())):
            self._merge(parent, tree, parent_node, by_id, extra)

    def _merge(self, request: Request, tree: PromiseTreeState, node: TreeNode,
               by_id: dict[str, EngineCoreOutput],
               extra: dict[int, list[EngineCoreOutput]]) -> None:
        """Appends the children's texts after `<sync>` and resumes.

        The merge is cut to leave room for one sampled token within the
        sequence's budget and the model length.
        """
        children = tree.take_unmerged(node)
        self._unpark(node)
        text = merged_text(children, self.special_kwargs.merge_separator)
        # Text that spells a special token stays text, never a control token.
        token_ids = self.tokenizer.encode(text,
                                          add_special_tokens=False,
                                          split_special_tokens=True)
        member = self.members[request.request_id]
        room = min(self.max_model_len - request.num_tokens,
                   request.max_tokens - request.num_output_tokens) - 1
        token_ids = token_ids[:max(room, 0)]
        tree.record_merged_tokens(node, request.num_tokens - member.start,
                                  len(token_ids))
        self.metrics.merged_tokens.inc(len(token_ids))
        if member.logprobs is not None:
            member.logprobs += [None] * len(token_ids)
        sync_token = request.all_token_ids[request.num_computed_tokens:]
        # Output so far becomes prompt; the budget keeps counting it.
        max_tokens = (request.max_tokens - request.num_output_tokens -
                      len(token_ids))
        params = request.sampling_params
        params.prompt_logprobs = None
        # The next chunk of the session: `<sync>` (sampled, not computed
        # yet) and the merged tokens. Upstream keeps the computed tokens'
        # KV and drops the uncomputed sampled token, given back here. The
        # model runner keeps the request's generator: a seeded parent goes
        # on with its own stream, replaying nothing.
        self._update_request_as_session(
            request,
            StreamingUpdate(mm_features=None,
                            prompt_token_ids=sync_token + token_ids,
                            max_tokens=max_tokens,
                            arrival_time=request.arrival_time,
                            sampling_params=params))
        if request.request_id in self.evicted:
            # No KV left: the resume is a new prefill of the whole
            # context, with a prefix-cache lookup, queued as one.
            self.evicted.discard(request.request_id)
            request.num_computed_tokens = 0
            self.kv_holding_waiting.remove_request(request)
            self.waiting.prepend_request(request)
        if token_ids:
            self._send_merged_tokens(request, token_ids, by_id, extra)

    def _send_merged_tokens(self, request: Request, token_ids: list[int],
                            by_id: dict[str, EngineCoreOutput],
                            extra: dict[int, list[EngineCoreOutput]]) -> None:
        """Sends merged tokens as new tokens of the request, with logprob
        rows of `MERGED_TOKEN_LOGPROB` if it asked for logprobs."""
        out = by_id.get(request.request_id)
        if out is None:
            out = EngineCoreOutput(request_id=request.request_id,
                                   new_token_ids=[])
            by_id[request.request_id] = out
            extra.setdefault(request.client_index, []).append(out)
        out.new_token_ids = list(out.new_token_ids) + token_ids
        if request.sampling_params.logprobs is None:
            return
        width = (1 if out.new_logprobs is None else
                 out.new_logprobs.logprob_token_ids.shape[1])
        # Every column names the merged token: one entry per position.
        rows = LogprobsLists(
            np.repeat(np.array(token_ids, dtype=np.int64)[:, None],
                      width,
                      axis=1),
            np.full((len(token_ids), width),
                    MERGED_TOKEN_LOGPROB,
                    dtype=np.float32), np.ones(len(token_ids), dtype=np.int64))
        if out.new_logprobs is not None:
            rows = LogprobsLists(
                *(np.concatenate([old, new])
                  for old, new in zip(out.new_logprobs[:3], rows[:3])))
        out.new_logprobs = rows

    def _report_tree(self, tree: PromiseTreeState,
                     out: Optional[EngineCoreOutput]) -> None:
        """Drops a finished root's tree; its snapshot goes with the output,
        as the plain data `PromiseNode.to_dict()` gives (the engine core
        sends its outputs to the frontend's process as msgpack)."""
        self._forget(tree)
        if out is not None:
            params = dict(out.kv_transfer_params or {})
            params[TREE_KEY] = tree.snapshot().to_dict(top_logprobs=True)
            out.kv_transfer_params = params

    def _report_sample_trees(self, out: EngineCoreOutput) -> None:
        """Sends a finished sample's tree, and its finished siblings', with
        its output: the frontend keeps the last finishing sample's
        `kv_transfer_params` for the request, and outputs reach it in the
        order sent."""
        samples = self._samples_of(out.request_id)
        if samples is None:
            return
        index = SAMPLE_ID.fullmatch(out.request_id)[1]
        params = dict(out.kv_transfer_params or {})
        tree = params.pop(TREE_KEY, None)
        if tree is not None:
            samples.trees[index] = tree
        if samples.trees:
            params[SAMPLE_TREES_KEY] = dict(samples.trees)
        out.kv_transfer_params = params or None
        self._sample_done(out.request_id)

    def _samples_of(self, request_id: str) -> Optional[Samples]:
        """The samples a live sample of an `n > 1` request belongs to."""
        match = SAMPLE_ID.fullmatch(request_id)
        samples = None if match is None else self.samples.get(match[2])
        return (samples if samples is not None and request_id in samples.live
                else None)

    def _sample_done(self, request_id: str) -> None:
        """Forgets a sample's request's samples when none is left live."""
        samples = self._samples_of(request_id)
        if samples is not None:
            samples.live.discard(request_id)
            if not samples.live:
                del self.samples[SAMPLE_ID.fullmatch(request_id)[2]]

    def _forget(self, tree: PromiseTreeState) -> None:
        for node in tree.root.subtree():
            self.trees.pop(node.request_id, None)
            self.members.pop(node.request_id, None)
            self.pending_forks.pop(node.request_id, None)
            self.evicted.discard(node.request_id)

    def _abort(self, tree: PromiseTreeState,
               nodes: Iterable[TreeNode]) -> None:
        live = [node for node in nodes if not node.is_finished]
        for node in live:
            tree.record_abort(node)
            self._unpark(node)
            if node.parent is not None:
                self.metrics.children_running.dec()
            self.pending_forks.pop(node.request_id, None)
            self.evicted.discard(node.request_id)
        if live:
            super().finish_requests([node.request_id for node in live],
                                    RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Any,
                        finished_status: RequestStatus) -> list[Request]:
        """Finishes as upstream; a finished root takes its tree along."""
        if isinstance(request_ids, str):
            request_ids = (request_ids, )
        if request_ids is not None:
            request_ids = list(request_ids)
        for request_id in list(self.requests if request_ids is
                               None else request_ids):
            self._sample_done(request_id)
            self.stop_checks.pop(request_id, None)
            tree = self.trees.get(request_id)
            if tree is not None and tree.root.request_id == request_id:
                self._abort(tree, tree.root.live_descendants())
                tree.record_abort(tree.root)
                self._unpark(tree.root)
                self._forget(tree)
        return super().finish_requests(request_ids, finished_status)

    def add_request(self, request: Request) -> None:
        """Adds as upstream; notes the samples of `n > 1` requests.

        The frontend sends a request's samples one right after the other.
        In process they all arrive before the next step; with the engine
        core in its own process, the tree of a sample that finished before
        a sibling arrived (within its first steps) goes with its own output
        only, not with the later samples'.
        """
        is_new = request.request_id not in self.requests
        super().add_request(request)
        match = SAMPLE_ID.fullmatch(request.request_id)
        if is_new and match is not None:
            self.samples.setdefault(match[2],
                                    Samples()).live.add(request.request_id)

    def get_tree_snapshot(self, request_id: str) -> Optional[dict[str, Any]]:
        """The live tree of a request, for inspection (None if none)."""
        tree = self.trees.get(request_id)
        return None if tree is None else tree.snapshot().to_dict()


def hooked_engine_args(special_kwargs: Any) -> dict[str, Any]:
    """Engine arguments that turn the hooks on, for `LLM(**...)`.

    Args:
        special_kwargs: A SpecialKwargs, a dict of its fields or its JSON.

    Returns:
        `scheduler_cls` and `additional_config` for `LLM` / `EngineArgs`.
    """
    if isinstance(special_kwargs, SpecialKwargs):
        special_kwargs = {
            name: getattr(special_kwargs, name)
            for name in SpecialKwargs.__dataclass_fields__
        }
    elif isinstance(special_kwargs, str):
        SpecialKwargs.from_json(special_kwargs)
    else:
        SpecialKwargs(**special_kwargs)
    return {
        "scheduler_cls": f"{__name__}.{SequenceHookScheduler.__qualname__}",
        "additional_config": {
            CONFIG_KEY: special_kwargs
        },
    }
