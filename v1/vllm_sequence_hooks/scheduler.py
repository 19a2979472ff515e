# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Promise/sync on vLLM's V1 engine: a scheduler subclass.

Selected with `scheduler_cls` (`--scheduler-cls`) and configured with
`additional_config={"special_kwargs": {...}}`. Every hook runs in the engine
core, after the stock `update_from_output` has appended and stop-checked the
step's sampled tokens. See docs/v1.md.
"""

from collections.abc import Iterable
from typing import Any, Optional

from vllm_sequence_hooks.tree import PromiseTree, TreeNode

from sequence_hooks import SpecialKwargs
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.tokenizers import cached_tokenizer_from_config
from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus, StreamingUpdate

logger = init_logger(__name__)

# Key of `additional_config` that holds the SpecialKwargs (dict or JSON).
CONFIG_KEY = "special_kwargs"
# Key of the root's `RequestOutput.kv_transfer_params` that carries the
# tree's snapshot: the one per-request dict V1 passes from the engine core
# to the frontend's outputs.
TREE_KEY = "promise_tree"


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
      at the end, the tree's snapshot reach the root's output.
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
        # Tree node of every live or finished-but-unreported tree member.
        self.nodes: dict[str, TreeNode] = {}
        # Trees by root request id.
        self.trees: dict[str, PromiseTree] = {}
        # Children not yet admitted: their prefix hit is the parent's blocks.
        self.pending_forks: dict[str, TreeNode] = {}
        # Original max_tokens of each tree member: a resume moves the
        # sequence's output into its prompt, which resets the count.
        self.budgets: dict[str, int] = {}
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
        parked = sum(node.parked for node in self.nodes.values())
        self.num_waiting_for_streaming_input -= parked
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self.num_waiting_for_streaming_input += parked
        if self.computed_log is not None:
            self.computed_log += [
                (self.current_step, request_id, n)
                for request_id, n in output.num_scheduled_tokens.items()
            ]
        return output

    def _get_local_prefix_cache_hit(self, request: Request):
        """A new child's hit is its parent's computed context."""
        node = self.pending_forks.pop(request.request_id, None)
        if node is not None:
            parent = self.requests.get(node.parent.request_id)
            if parent is not None and self._holds_kv_blocks(parent):
                shared = min(node.num_shared_tokens,
                             parent.num_computed_tokens)
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
            # Decided before the hooks run: a finished root drops its nodes.
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
        return engine_outputs

    def _is_child(self, request_id: str) -> bool:
        node = self.nodes.get(request_id)
        return node is not None and node.parent is not None

    def _on_output(self, request: Request, out: EngineCoreOutput,
                   by_id: dict[str, EngineCoreOutput],
                   extra: dict[int, list[EngineCoreOutput]]) -> None:
        if out.finish_reason is None and request.is_finished():
            # Aborted earlier in this step, with its finished ancestor.
            return
        node = self.nodes.get(request.request_id)
        if out.finish_reason is not None:
            if node is not None and not node.is_finished:
                self._finish(request, node, str(out.finish_reason), by_id,
                             extra)
            return
        if not out.new_token_ids or node is not None and node.is_finished:
            return
        token_id = out.new_token_ids[-1]
        if token_id == self.special_kwargs.promise_token_id:
            self._promise(request)
        elif token_id == self.special_kwargs.sync_token_id and node:
            self._sync(request, node, by_id, extra)

    # ---------------------------------------------------------------- hooks

    def _node_of(self, request: Request) -> TreeNode:
        node = self.nodes.get(request.request_id)
        if node is None:
            # A resume extends the prompt in place; with the engine core in
            # process, the frontend holds the same list.
            request.prompt_token_ids = list(request.prompt_token_ids)
            node = TreeNode(request.request_id)
            self.nodes[request.request_id] = node
            self.trees[request.request_id] = PromiseTree(node)
            self.budgets[request.request_id] = request.max_tokens
        return node

    def _tree_of(self, node: TreeNode) -> PromiseTree:
        while node.parent is not None:
            node = node.parent
        return self.trees[node.request_id]

    def _promise(self, parent: Request) -> None:
        node = self._node_of(parent)
        tree = self._tree_of(node)
        limits = self.special_kwargs
        if (len(node.children) >= limits.max_children_per_sequence
                or tree.num_spawned >= limits.max_children_per_request
                or node.depth >= limits.max_depth):
            tree.num_refused += 1
            return
        marker = ([] if limits.child_role_token_id is None else
                  [limits.child_role_token_id])
        context = list(parent.all_token_ids) + marker
        tree.num_spawned += 1
        child_id = f"{tree.root.request_id}/promise-{tree.num_spawned}"
        params = parent.sampling_params.clone()
        # Its prompt is the parent's context: no prompt logprobs, and its
        # own budget, counted from the fork.
        params.prompt_logprobs = None
        params.max_tokens = self.budgets[tree.root.request_id]
        child = Request(request_id=child_id,
                        prompt_token_ids=context,
                        sampling_params=params,
                        pooling_params=None,
                        client_index=parent.client_index,
                        lora_request=parent.lora_request,
                        cache_salt=parent.cache_salt,
                        priority=parent.priority,
                        block_hasher=parent._block_hasher)
        child_node = TreeNode(child_id,
                              depth=node.depth + 1,
                              parent=node,
                              fork_len=len(context),
                              num_shared_tokens=parent.num_computed_tokens)
        node.children.append(child_node)
        self.nodes[child_id] = child_node
        self.budgets[child_id] = params.max_tokens
        self.pending_forks[child_id] = child_node
        self.requests[child_id] = child
        # Ahead of new requests: it continues work already admitted.
        self.waiting.prepend_request(child)

    def _sync(self, request: Request, node: TreeNode,
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
        node.parked = True
        if all(child.is_finished for child in pending):
            self._merge(request, node, by_id, extra)

    def _finish(self, request: Request, node: TreeNode, reason: str,
                by_id: dict[str, EngineCoreOutput],
                extra: dict[int, list[EngineCoreOutput]]) -> None:
        """Records a finished tree member and wakes its parent."""
        node.finish_reason = reason
        self._abort(node.live_descendants())
        if node.parent is None:
            self._report_tree(node, by_id.get(request.request_id))
            return
        node.token_ids = list(request.all_token_ids[node.fork_len:])
        node.text = self.tokenizer.decode(
            [t for t in node.token_ids if t not in self.hook_token_ids],
            skip_special_tokens=True)
        self.budgets.pop(node.request_id, None)
        parent_node = node.parent
        parent = self.requests.get(parent_node.request_id)
        if (parent is not None and parent_node.parked
                and all(child.is_finished
                        for child in parent_node.unmerged_children())):
            self._merge(parent, parent_node, by_id, extra)

    def _merge(self, request: Request, node: TreeNode,
               by_id: dict[str, EngineCoreOutput],
               extra: dict[int, list[EngineCoreOutput]]) -> None:
        """Appends the children's texts after `<sync>` and resumes.

        The merge is cut to leave room for one sampled token within the
        sequence's budget and the model length.
        """
        children = node.unmerged_children()
        node.num_merged = len(node.children)
        node.parked = False
        text = self.special_kwargs.merge_separator.join(child.text
                                                        for child in children)
        token_ids = self.tokenizer.encode(text,
                                          add_special_tokens=False,
                                          split_special_tokens=True)
        room = min(self.max_model_len - request.num_tokens,
                   request.max_tokens - request.num_output_tokens) - 1
        token_ids = token_ids[:max(room, 0)]
        node.num_merged_tokens += len(token_ids)
        sync_token = request.all_token_ids[request.num_computed_tokens:]
        # Output so far becomes prompt; the budget keeps counting it.
        max_tokens = (request.max_tokens - request.num_output_tokens -
                      len(token_ids))
        params = request.sampling_params
        params.prompt_logprobs = None
        # The next chunk of the session: `<sync>` (sampled, not computed
        # yet) and the merged tokens. Upstream keeps the computed tokens'
        # KV and drops the uncomputed sampled token, given back here.
        self._update_request_as_session(
            request,
            StreamingUpdate(mm_features=None,
                            prompt_token_ids=sync_token + token_ids,
                            max_tokens=max_tokens,
                            arrival_time=request.arrival_time,
                            sampling_params=params))
        if not token_ids:
            return
        out = by_id.get(request.request_id)
        if out is not None:
            out.new_token_ids = list(out.new_token_ids) + token_ids
        else:
            out = EngineCoreOutput(request_id=request.request_id,
                                   new_token_ids=list(token_ids))
            by_id[request.request_id] = out
            extra.setdefault(request.client_index, []).append(out)

    def _report_tree(self, root: TreeNode,
                     out: Optional[EngineCoreOutput]) -> None:
        """Drops a finished root's tree; its snapshot goes with the output."""
        tree = self.trees.pop(root.request_id)
        for node in self._all_nodes(root):
            self.nodes.pop(node.request_id, None)
            self.budgets.pop(node.request_id, None)
            self.pending_forks.pop(node.request_id, None)
        if out is not None:
            params = dict(out.kv_transfer_params or {})
            params[TREE_KEY] = dict(root.snapshot(),
                                    num_refused=tree.num_refused)
            out.kv_transfer_params = params

    def _all_nodes(self, node: TreeNode) -> list[TreeNode]:
        nodes = [node]
        for child in node.children:
            nodes += self._all_nodes(child)
        return nodes

    def _abort(self, nodes: Iterable[TreeNode]) -> None:
        live = [node for node in nodes if not node.is_finished]
        for node in live:
            node.finish_reason = "abort"
            node.parked = False
            self.pending_forks.pop(node.request_id, None)
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
            for request_id in list(request_ids):
                node = self.nodes.get(request_id)
                if node is not None and node.parent is None:
                    self._abort(node.live_descendants())
                    node.finish_reason = "abort"
                    node.parked = False
                    self.trees.pop(request_id, None)
                    for member in self._all_nodes(node):
                        self.nodes.pop(member.request_id, None)
                        self.budgets.pop(member.request_id, None)
        else:
            self.nodes.clear()
            self.trees.clear()
            self.budgets.clear()
            self.pending_forks.clear()
        return super().finish_requests(request_ids, finished_status)

    def get_tree_snapshot(self, request_id: str) -> Optional[dict[str, Any]]:
        """The live tree of a request, for inspection (None if none)."""
        tree = self.trees.get(request_id)
        return None if tree is None else tree.root.snapshot()


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
