# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The client-side join: promise/sync run by a client on a stock engine.

This is the peer the hooks are measured against: the way APR- and
ThreadWeaver-style systems run parallel reasoning on unmodified vLLM. A
`JoinTask` streams its request's sequence; each `<promise>` the sequence
samples launches, at once, one child request whose prompt is the context
the hooked engine gives that child (the whole context up to and including
the `<promise>`, then the role marker if configured). Every request stops
at `<sync>` (a stop token); when the sequence's unmerged children have all
finished, their texts are merged as the hooks merge them and one
continuation request goes out over the context, the `<sync>` and the
merged tokens. Children promise and sync the same way, recursively.

It mirrors the hooks' contract (docs/sequence-hooks.md): the same limits
(a refused `<promise>` stays an ordinary token), budgets (a child's
`max_tokens` counts its own tokens; merged tokens count toward the
parent's; a merge is cut to leave room for one sampled token within
`max_tokens` and the model length), finishing (a hook token that is the
last allowed token finishes the sequence with "length"; a sequence that
finishes aborts its unfinished descendants; a `<sync>` with no unmerged
child is an ordinary token) and texts (the engine's incremental
detokenization, hook tokens removed from a child's merged text). It keeps
its tree in the engine-neutral `PromiseTreeState`, so its result has the
hooked engine's `PromiseNode` shape.

The join logic is transport-neutral: a transport sends a request and
calls back with its new tokens. `EngineTransport` drives an in-process
`LLMEngine` step by step (a child request is added right after the step
that sampled its `<promise>`, as the hooks spawn it);
`sequence_hooks_testkit.client_join_http` streams from an OpenAI-compatible
server.

Not mirrored: stop strings, `min_tokens` (it would mask the `<sync>` stop
token) and seeded sampling (the hooks derive a seed per child and resume;
a client cannot reproduce their random streams): refused, except seeds,
which are passed through unchanged.
"""

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from sequence_hooks.special_kwargs import SpecialKwargs
from sequence_hooks.tree import (PromiseNode, PromiseTreeState, TreeNode,
                                 merged_text, without_hook_tokens)

# A sequence's place in its tree: () for the request's own sequence, (1,)
# for the child of its second promise, (1, 0) for that child's first child.
RolePath = tuple[int, ...]
# Extra request options per sequence and segment: called with the
# sequence's role path and the number of tokens it has sampled so far
# (scripted test programs use both); the transport interprets the dict.
OptionsFn = Callable[[RolePath, int], dict]
# Receives a request's new token ids and, with its last ones, its finish
# reason.
OutputCallback = Callable[[list[int], Optional[str]], None]


@dataclass
class JoinRequest:
    """One request the join sends."""
    # Unique request id.
    request_id: str
    # The prompt, as token ids.
    prompt_ids: list[int]
    # Tokens it may generate.
    max_tokens: int
    # Token ids that end it (the `<sync>` token).
    stop_token_ids: list[int]
    # Further options (see `OptionsFn`).
    options: dict
    # Called with its new tokens as they come.
    on_output: OutputCallback
    # Called if the transport fails it.
    on_error: Callable[[BaseException], None]


class Transport(Protocol):
    """Sends the join's requests to an engine and streams their tokens."""

    def submit(self, request: JoinRequest) -> None:
        ...

    def cancel(self, request_id: str) -> None:
        ...


class IncrementalText:
    """A sequence's output text, built token by token as the engine's
    detokenizer builds it (`Detokenizer.decode_sequence_inplace`).

    Args:
        tokenizer: The model's tokenizer (as `vllm`'s `get_tokenizer`
            gives it).
        prompt_ids: The sequence's prompt.
    """

    def __init__(self, tokenizer, prompt_ids: list[int]):
        from vllm.transformers_utils.detokenizer_utils import (
            convert_prompt_ids_to_tokens)
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)
        self.tokens, self.prefix_offset, self.read_offset = (
            convert_prompt_ids_to_tokens(tokenizer,
                                         self.ids,
                                         skip_special_tokens=True))
        self.text = ""

    def copy(self) -> "IncrementalText":
        clone = object.__new__(IncrementalText)
        clone.__dict__.update(self.__dict__)
        clone.ids, clone.tokens = list(self.ids), list(self.tokens)
        return clone

    def append(self, token_id: int) -> None:
        """Appends one token and its text."""
        from vllm.transformers_utils.detokenizer_utils import (
            detokenize_incrementally)
        self.ids.append(token_id)
        new_tokens, new_text, self.prefix_offset, self.read_offset = (
            detokenize_incrementally(self.tokenizer,
                                     self.ids,
                                     self.tokens,
                                     self.prefix_offset,
                                     self.read_offset,
                                     skip_special_tokens=True))
        self.tokens.extend(new_tokens)
        self.text += new_text


@dataclass(eq=False)
class JoinSequence:
    """The client's state of one sequence of a join's tree."""
    # Its node in the tree.
    node: TreeNode
    # Its role path.
    role: RolePath
    # Its context and own tokens so far, with their text.
    text: IncrementalText
    # Tokens of ``text.ids`` before its own (the context it started with).
    context_len: int
    # Characters of ``text.text`` before its own.
    fork_text_len: int
    # Own tokens it sampled (merged tokens and the role marker excluded).
    sampled: int = 0
    # The id of its request in flight; None while parked or finished.
    request_id: Optional[str] = None
    # Waiting at a `<sync>` for its unmerged children.
    parked: bool = False

    @property
    def own_ids(self) -> list[int]:
        return self.text.ids[self.context_len:]


@dataclass
class JoinResult:
    """What a join produced, and what it cost."""
    # The request's output token ids (merged tokens included).
    token_ids: list[int]
    # Its output text.
    text: str
    # "stop" or "length".
    finish_reason: str
    # The tree, as the hooked engine's `RequestOutput.promise_tree`.
    promise_tree: PromiseNode
    # Requests sent.
    requests: int
    # Prompt tokens sent over all requests (before prefix-cache hits).
    prompt_tokens: int


class JoinTask:
    """Runs one request's promise/sync tree from the client.

    Args:
        task_id: Unique id; request ids derive from it.
        prompt_ids: The request's prompt.
        max_tokens: The request's budget (each child's, for its own
            tokens).
        hooks: The hook tokens, merge separator and limits, as ids.
        max_model_len: The engine's longest sequence.
        tokenizer: The model's tokenizer.
        transport: Where requests go.
        options: Extra options per sequence and segment.
        on_done: Called with the task once its result is ready.
    """

    def __init__(self,
                 task_id: str,
                 prompt_ids: list[int],
                 max_tokens: int,
                 hooks: SpecialKwargs,
                 max_model_len: int,
                 tokenizer,
                 transport: Transport,
                 options: Optional[OptionsFn] = None,
                 on_done: Optional[Callable[["JoinTask"], None]] = None):
        self.task_id = task_id
        self.prompt_ids = list(prompt_ids)
        self.max_tokens = max_tokens
        self.hooks = hooks
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.transport = transport
        self.options = options or (lambda role, sampled: {})
        self.on_done = on_done
        self.hook_strings = tokenizer.convert_ids_to_tokens(
            sorted(hooks.hook_token_ids))
        self.tree = PromiseTreeState(root=TreeNode(task_id))
        self.sequences = {
            task_id:
            JoinSequence(self.tree.root, (),
                         IncrementalText(tokenizer, self.prompt_ids),
                         len(self.prompt_ids), 0)
        }
        self.request_counter = itertools.count()
        self.requests = 0
        self.prompt_tokens = 0
        self.result: Optional[JoinResult] = None
        self.error: Optional[BaseException] = None

    def start(self) -> None:
        """Sends the request's first segment."""
        self._send(self.sequences[self.task_id])

    # Requests.

    def _send(self, seq: JoinSequence) -> None:
        """Sends ``seq``'s next segment: its context and own tokens so far
        as the prompt."""
        prompt = list(seq.text.ids)
        budget = min(self.max_tokens - len(seq.own_ids),
                     self.max_model_len - len(prompt))
        request_id = f"{self.task_id}-{next(self.request_counter)}"
        seq.request_id = request_id
        self.requests += 1
        self.prompt_tokens += len(prompt)
        self.transport.submit(
            JoinRequest(
                request_id, prompt, budget, [self.hooks.sync_token_id],
                self.options(seq.role,
                             seq.sampled), lambda ids, reason: self._on_output(
                                 seq, request_id, ids, reason), self._fail))

    def _fail(self, error: BaseException) -> None:
        if self.error is None and self.result is None:
            self.error = error
            self._cancel_all()
            if self.on_done is not None:
                self.on_done(self)

    def _cancel_all(self) -> None:
        for seq in self.sequences.values():
            if seq.request_id is not None:
                self.transport.cancel(seq.request_id)
                seq.request_id = None

    # What the engine sampled.

    def _on_output(self, seq: JoinSequence, request_id: str,
                   token_ids: list[int], finish_reason: Optional[str]) -> None:
        if seq.request_id != request_id:
            # Cancelled (its sequence was aborted); late tokens are void.
            return
        for i, token_id in enumerate(token_ids):
            seq.text.append(token_id)
            seq.sampled += 1
            last = finish_reason is not None and i == len(token_ids) - 1
            if token_id == self.hooks.promise_token_id and not last:
                self._promise(seq)
        if finish_reason is None:
            return
        seq.request_id = None
        own = seq.own_ids
        if (own and own[-1] == self.hooks.sync_token_id
                and finish_reason == "stop"):
            if (len(own) >= self.max_tokens
                    or len(seq.text.ids) >= self.max_model_len):
                # The hooks' stop check runs first: a `<sync>` that is the
                # last allowed token ends the sequence.
                self._finish(seq, "length")
            else:
                self._sync(seq)
            return
        self._finish(seq, finish_reason)

    def _promise(self, seq: JoinSequence) -> None:
        """Spawns a child of ``seq``, unless a limit says no."""
        if not self.tree.may_spawn(seq.node, self.hooks):
            return
        child_id = f"{self.task_id}/promise-{self.tree.num_spawned}"
        text = seq.text.copy()
        fork_position = len(seq.own_ids)
        if self.hooks.child_role_token_id is not None:
            text.append(self.hooks.child_role_token_id)
        node = self.tree.add_child(seq.node, child_id, fork_position, 0, 0,
                                   0.0)
        child = JoinSequence(node, seq.role + (len(seq.node.children) - 1, ),
                             text, len(text.ids), len(text.text))
        self.sequences[child_id] = child
        self._send(child)

    def _sync(self, seq: JoinSequence) -> None:
        pending = seq.node.unmerged_children()
        if all(child.is_finished for child in pending):
            self._merge_and_resume(seq)
        else:
            seq.parked = True

    def _merge_and_resume(self, seq: JoinSequence) -> None:
        """Merges ``seq``'s unmerged children (if any) as the hooks do, and
        sends its continuation."""
        children = self.tree.take_unmerged(seq.node)
        if children:
            text = merged_text(children, self.hooks.merge_separator)
            token_ids = self.tokenizer.encode(text,
                                              add_special_tokens=False,
                                              split_special_tokens=True)
            room = min(self.max_model_len - len(seq.text.ids) - 1,
                       self.max_tokens - len(seq.own_ids) - 1)
            token_ids = token_ids[:max(room, 0)]
            self.tree.record_merged_tokens(seq.node, len(seq.own_ids),
                                           len(token_ids))
            for token_id in token_ids:
                seq.text.append(token_id)
        seq.parked = False
        self._send(seq)

    def _finish(self, seq: JoinSequence, reason: str) -> None:
        """Records a finished sequence, aborts its unfinished descendants
        and wakes its parked parent."""
        self._abort_descendants(seq.node)
        own_text = seq.text.text[seq.fork_text_len:]
        self.tree.record_finish(
            seq.node, reason, seq.own_ids,
            without_hook_tokens(own_text, self.hook_strings))
        parent_node = seq.node.parent
        if parent_node is None:
            self._done(seq)
            return
        parent = self.sequences[parent_node.request_id]
        if parent.parked and all(child.is_finished
                                 for child in parent_node.unmerged_children()):
            self._merge_and_resume(parent)

    def _abort_descendants(self, node: TreeNode) -> None:
        for child in node.children:
            if child.is_finished:
                continue
            self._abort_descendants(child)
            seq = self.sequences[child.request_id]
            if seq.request_id is not None:
                self.transport.cancel(seq.request_id)
                seq.request_id = None
            seq.parked = False
            self.tree.record_abort(child)

    def _done(self, root: JoinSequence) -> None:
        self.result = JoinResult(root.own_ids,
                                 root.text.text, root.node.finish_reason,
                                 self.tree.snapshot(), self.requests,
                                 self.prompt_tokens)
        if self.on_done is not None:
            self.on_done(self)


class EngineTransport:
    """Sends the join's requests to an in-process stock `LLMEngine` and
    steps it.

    Outputs are handed to the join right after each step, so a child
    request is added before the next step, as the hooks add a child.

    Args:
        engine: A stock `LLMEngine` (no `special_kwargs`).
        defaults: `SamplingParams` arguments of every request
            (e.g. temperature).
    """

    def __init__(self, engine, defaults: Optional[dict] = None):
        self.engine = engine
        self.defaults = dict(defaults or {})
        for refused in ("stop", "min_tokens"):
            if self.defaults.get(refused):
                raise ValueError(f"the client-side join does not mirror "
                                 f"{refused!r}")
        # Request id -> (request, tokens delivered so far).
        self._live: dict[str, list[Any]] = {}

    def submit(self, request: JoinRequest) -> None:
        from vllm import SamplingParams
        params = SamplingParams(
            **{
                **self.defaults,
                **request.options,
                "max_tokens": request.max_tokens,
                "stop_token_ids": request.stop_token_ids,
            })
        self.engine.add_request(request.request_id,
                                {"prompt_token_ids": request.prompt_ids},
                                params)
        self._live[request.request_id] = [request, 0]

    def cancel(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)

    def step(self) -> None:
        """Runs one engine step and delivers its new tokens."""
        for output in self.engine.step():
            entry = self._live.get(output.request_id)
            if entry is None:
                continue
            request, seen = entry
            completion = output.outputs[0]
            entry[1] = len(completion.token_ids)
            if output.finished:
                del self._live[output.request_id]
            request.on_output(list(completion.token_ids[seen:]),
                              completion.finish_reason)

    def run(self, tasks: list[JoinTask], max_steps: int = 100000) -> None:
        """Starts ``tasks`` and steps the engine until all are done.

        Raises:
            RuntimeError: a task failed, or they did not finish in
                ``max_steps`` steps.
        """
        for task in tasks:
            task.start()
        for _ in range(max_steps):
            if not self._live:
                break
            self.step()
        for task in tasks:
            if task.error is not None:
                raise RuntimeError(f"join {task.task_id} failed") from (
                    task.error)
            if task.result is None:
                raise RuntimeError(f"join {task.task_id} did not finish")


def run_joins(engine,
              prompts: list[list[int]],
              max_tokens: int,
              hooks: SpecialKwargs,
              options: Optional[list[Optional[OptionsFn]]] = None,
              defaults: Optional[dict] = None) -> list[JoinResult]:
    """Runs one join per prompt, all at once, on an in-process engine.

    Args:
        engine: A stock `LLMEngine`.
        prompts: The prompts, as token ids.
        max_tokens: Each request's budget.
        hooks: The hook configuration, resolved to ids.
        options: Per prompt, its extra options per sequence and segment.
        defaults: `SamplingParams` arguments of every request.

    Returns:
        The results, in prompt order.
    """
    transport = EngineTransport(engine, defaults)
    tokenizer = engine.get_tokenizer()
    max_model_len = engine.model_config.max_model_len
    options = options or [None] * len(prompts)
    tasks = [
        JoinTask(f"join-{i}-{id(transport)}", prompt, max_tokens, hooks,
                 max_model_len, tokenizer, transport, task_options)
        for i, (prompt, task_options) in enumerate(zip(prompts, options))
    ]
    transport.run(tasks)
    return [task.result for task in tasks]


def scripted_options(plans, ids, over_http: bool = False) -> OptionsFn:
    """The options that run a scripted program's sequences on a stock
    engine: each segment's processor gets its sequence's role path and
    plan step, which a stock engine cannot infer from the context.

    Args:
        plans: The program (see `scripted_hooks.ScriptedHooks`).
        ids: The tiny tokenizer's `HookIds`.
        over_http: Request-body fields for a server (which must allow the
            kit's processors, `server.SCRIPTED_PATTERN`) instead of
            `SamplingParams` arguments.
    """
    from sequence_hooks_testkit.oracle import scripted
    from sequence_hooks_testkit.server import scripted_request_body
    if over_http:
        return lambda role, step: scripted_request_body(plans, ids, role, step)
    return lambda role, step: {
        "logits_processors": [scripted(plans, ids, role=role, step=step)]
    }
