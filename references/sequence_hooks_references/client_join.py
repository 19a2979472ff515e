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

It runs the hooks' own lifecycle (`sequence_hooks.lifecycle`): every
decision (limits, child ids, budgets, merges and their cut, the abort
cascade, texts without hook tokens) is the `Coordinator`'s that
the hooked engines use; a `JoinTask` carries out its actions with
requests: a fork sends the child's context as a prompt, a
park waits, a resume sends a continuation. What stays the client's:
finishing (a hook token that is the last allowed token finishes the
sequence with "length", as the engine's stop check runs first) and the
engine's incremental detokenization of each sequence's text: V0's
(`IncrementalText`) with vLLM 0.9, V1's frontend's (`FrontendText`) with
vLLM 0.3x, where a child's text starts after its context as the V1
plugin's child request's does.

The join logic is sender-neutral: a sender sends a request and
calls back with its new tokens. `EngineSender` drives an in-process
`LLMEngine` step by step (a child request is added right after the step
that sampled its `<promise>`, as the hooks spawn it);
`sequence_hooks_references.client_join_http` streams from an
OpenAI-compatible server.

Not mirrored: stop strings, `min_tokens` (it would mask the `<sync>` stop
token) and seeded sampling (the hooks derive a seed per child and resume;
a client cannot reproduce their random streams): refused, except seeds,
which are passed through unchanged.
"""

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from sequence_hooks.actions import (Abort, Action, Fork, MemberResult, Park,
                                    ReportTree, RequestParams, Resume)
from sequence_hooks.lifecycle import Coordinator
from sequence_hooks.special_kwargs import SpecialKwargs
from sequence_hooks.tree import PromiseNode

# A sequence's place in its tree: () for the request's own sequence, (1,)
# for the child of its second promise, (1, 0) for that child's first child.
RolePath = tuple[int, ...]
# Extra request options per sequence and segment: called with the
# sequence's role path and the number of tokens it has sampled so far
# (scripted test programs use both); the sender interprets the dict.
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
    # Called if the sender fails it.
    on_error: Callable[[BaseException], None]


class RequestSender(Protocol):
    """Sends the join's requests to an engine and streams their tokens."""

    def submit(self, request: JoinRequest) -> None:
        ...

    def cancel(self, request_id: str) -> None:
        ...


class IncrementalText:
    """A sequence's output text, built token by token as V0's detokenizer
    builds it (`Detokenizer.decode_sequence_inplace`).

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

    def forked(self, token_ids: list[int]) -> "IncrementalText":
        """A child's text: this sequence's, continued with ``token_ids``
        (V0 forks the sequence, detokenizer state included)."""
        clone = object.__new__(IncrementalText)
        clone.__dict__.update(self.__dict__)
        clone.ids, clone.tokens = list(self.ids), list(self.tokens)
        for token_id in token_ids:
            clone.append(token_id)
        return clone

    def append(self, token_id: int) -> None:
        """Appends one token and its text."""
        from vllm.transformers_utils.detokenizer_utils import (
            detokenize_incrementally)
        self.ids.append(token_id)
        new_tokens, piece, self.prefix_offset, self.read_offset = (
            detokenize_incrementally(self.tokenizer,
                                     self.ids,
                                     self.tokens,
                                     self.prefix_offset,
                                     self.read_offset,
                                     skip_special_tokens=True))
        self.tokens.extend(new_tokens)
        self.text += piece


class FrontendText:
    """A sequence's output text as V1's frontend builds it (its
    `IncrementalDetokenizer`, the one the V1 plugin's
    `stop_strings.frontend_text` uses for a member's text).

    Args:
        tokenizer: The model's tokenizer.
        prompt_ids: The sequence's prompt: a child's starts after its
            `<promise>` and role marker, as the plugin's child request's.
    """

    def __init__(self, tokenizer, prompt_ids: list[int]):
        from types import SimpleNamespace

        from vllm import SamplingParams
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)
        self._detokenizer = IncrementalDetokenizer.from_new_request(
            tokenizer,
            SimpleNamespace(request_id="",
                            prompt_token_ids=list(prompt_ids),
                            prompt_embeds=None,
                            sampling_params=SamplingParams()))

    @property
    def text(self) -> str:
        return self._detokenizer.output_text

    def forked(self, token_ids: list[int]) -> "FrontendText":
        """A child's text: a new request over this sequence's context and
        ``token_ids`` (V1 forks by a new request)."""
        return FrontendText(self.tokenizer, self.ids + list(token_ids))

    def append(self, token_id: int) -> None:
        """Appends one token and its text."""
        self.ids.append(token_id)
        self._detokenizer.update([token_id], False)


def new_text(tokenizer, prompt_ids: list[int]):
    """A request's text, as the installed vLLM's engine builds it: V0's
    detokenizer (vLLM 0.9) or V1's frontend (vLLM 0.3x).

    Args:
        tokenizer: The model's tokenizer.
        prompt_ids: The request's prompt.

    Returns:
        An `IncrementalText` or a `FrontendText`.
    """
    try:
        import vllm.transformers_utils.detokenizer_utils  # noqa: F401
    except ImportError:
        return FrontendText(tokenizer, prompt_ids)
    return IncrementalText(tokenizer, prompt_ids)


@dataclass(eq=False)
class JoinSequence:
    """The client's state of one sequence of a join's tree."""
    # Its member id in the tree (`sequence_hooks.child_request_id`).
    member_id: str
    # Its role path.
    role: RolePath
    # Its context and own tokens so far, with their text.
    text: "IncrementalText | FrontendText"
    # Tokens of ``text.ids`` before its own (the context it started with).
    context_len: int
    # Characters of ``text.text`` before its own.
    fork_text_len: int
    # Own tokens it sampled (merged tokens and the role marker excluded).
    sampled: int = 0
    # Children it spawned.
    num_children: int = 0
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
    # The tree, as the hooked engine's `RequestOutput.promise_tree` (a
    # childless root if it never promised).
    promise_tree: PromiseNode
    # Requests sent.
    requests: int
    # Prompt tokens sent over all requests (before prefix-cache hits).
    prompt_tokens: int


class JoinTask:
    """Runs one request's promise/sync tree from the client: the engine
    mechanics of `sequence_hooks.lifecycle` done with requests (it carries
    out the actions), every decision left to its `Coordinator`.

    Args:
        task_id: Unique id; request ids derive from it.
        prompt_ids: The request's prompt.
        max_tokens: The request's budget (each child's, for its own
            tokens).
        special_kwargs: The hook tokens, merge separator and limits, as ids.
        max_model_len: The engine's longest sequence.
        tokenizer: The model's tokenizer.
        sender: Where requests go.
        options: Extra options per sequence and segment.
        on_done: Called with the task once its result is ready.
    """

    def __init__(self,
                 task_id: str,
                 prompt_ids: list[int],
                 max_tokens: int,
                 special_kwargs: SpecialKwargs,
                 max_model_len: int,
                 tokenizer,
                 sender: RequestSender,
                 options: Optional[OptionsFn] = None,
                 on_done: Optional[Callable[["JoinTask"], None]] = None):
        self.task_id = task_id
        self.prompt_ids = list(prompt_ids)
        self.max_tokens = max_tokens
        self.special_kwargs = special_kwargs
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.sender = sender
        self.options = options or (lambda role, sampled: {})
        self.on_done = on_done
        # Seeds go through unchanged (`_fork`): no resume reseeds.
        self.coordinator = Coordinator.for_format(special_kwargs,
                                                  max_model_len,
                                                  tokenizer,
                                                  clock=time.monotonic)
        self.sequences = {
            task_id:
            JoinSequence(task_id, (), new_text(tokenizer, self.prompt_ids),
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
        self.sender.submit(
            JoinRequest(
                request_id, prompt, budget,
                [self.special_kwargs.sync_token_id],
                self.options(seq.role,
                             seq.sampled), lambda ids, reason: self._on_output(
                                 seq, request_id, ids, reason), self._fail))

    def _fail(self, error: BaseException) -> None:
        if self.error is None and self.result is None:
            self.error = error
            self._cancel([
                member_id for member_id, seq in self.sequences.items()
                if seq.request_id is not None
            ])
            if self.on_done is not None:
                self.on_done(self)

    # What the engine sampled: the coordinator's events.

    def _params(self) -> RequestParams:
        """The request's parameters, as the lifecycle reads them."""
        return RequestParams(prompt_len=len(self.prompt_ids),
                             max_tokens=self.max_tokens)

    def _on_output(self, seq: JoinSequence, request_id: str,
                   token_ids: list[int], finish_reason: Optional[str]) -> None:
        if seq.request_id != request_id:
            # Cancelled (its sequence was aborted); late tokens are void.
            return
        member_id = seq.member_id
        for i, token_id in enumerate(token_ids):
            seq.text.append(token_id)
            seq.sampled += 1
            last = finish_reason is not None and i == len(token_ids) - 1
            if token_id == self.special_kwargs.promise_token_id and not last:
                self._carry_out(
                    self.coordinator.sampled(member_id, seq.text.ids,
                                             self._params))
        if finish_reason is None:
            return
        seq.request_id = None
        own = seq.own_ids
        if (own and own[-1] == self.special_kwargs.sync_token_id
                and finish_reason == "stop"):
            if (len(own) >= self.max_tokens
                    or len(seq.text.ids) >= self.max_model_len):
                # The hooks' stop check runs first: a `<sync>` that is the
                # last allowed token ends the sequence.
                self._finish(seq, member_id, "length")
            else:
                actions = self.coordinator.sampled(member_id, seq.text.ids,
                                                   self._params)
                if not actions:
                    # An ordinary `<sync>`: the sequence goes on.
                    self._send(seq)
                self._carry_out(actions)
            return
        self._finish(seq, member_id, finish_reason)

    def _finish(self, seq: JoinSequence, member_id: str, reason: str) -> None:
        if self.coordinator.is_member(member_id):
            self._carry_out(
                self.coordinator.finished(
                    member_id, reason,
                    MemberResult(seq.own_ids,
                                 seq.text.text[seq.fork_text_len:])))
        else:
            # A request that never promised: a childless tree.
            self._done(
                PromiseNode(member_id, 0, (), seq.text.text,
                            tuple(seq.own_ids), reason, 0))

    def _done(self, tree: PromiseNode) -> None:
        root = self.sequences[self.task_id]
        self.result = JoinResult(root.own_ids, root.text.text,
                                 tree.finish_reason, tree, self.requests,
                                 self.prompt_tokens)
        if self.on_done is not None:
            self.on_done(self)

    # The coordinator's actions, carried out.

    def _carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Fork):
                self._fork(action)
            elif isinstance(action, Park):
                self.sequences[action.member_id].parked = True
            elif isinstance(action, Resume):
                self._resume(action)
            elif isinstance(action, Abort):
                self._cancel(action.member_ids)
            elif isinstance(action, ReportTree):
                self._done(action.tree)
            # StartTree: the join keeps no record of its own.

    def _fork(self, child: Fork) -> None:
        # Seeds go through unchanged (a client cannot reproduce the hooks'
        # random streams), budgets are the request's (`_send`).
        parent = self.sequences[child.parent_id]
        text = parent.text.forked(child.context_tokens)
        seq = JoinSequence(child.request_id,
                           parent.role + (parent.num_children, ), text,
                           len(text.ids), len(text.text))
        parent.num_children += 1
        self.sequences[child.request_id] = seq
        self._send(seq)

    def _resume(self, resume: Resume) -> None:
        seq = self.sequences[resume.member_id]
        for token_id in resume.token_ids:
            seq.text.append(token_id)
        seq.parked = False
        self._send(seq)

    def _cancel(self, member_ids) -> None:
        for member_id in member_ids:
            seq = self.sequences[member_id]
            if seq.request_id is not None:
                self.sender.cancel(seq.request_id)
                seq.request_id = None
            seq.parked = False


def sender_defaults(defaults: Optional[dict]) -> dict:
    """A sender's request defaults, checked: the join does not mirror stop
    strings nor a minimum of tokens.

    Args:
        defaults: Request arguments of every request, or None.

    Returns:
        A copy of ``defaults`` (empty for None).

    Raises:
        ValueError: ``defaults`` sets ``stop`` or ``min_tokens``.
    """
    defaults = dict(defaults or {})
    for refused in ("stop", "min_tokens"):
        if defaults.get(refused):
            raise ValueError(f"the client-side join does not mirror "
                             f"{refused!r}")
    return defaults


class EngineSender:
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
        self.defaults = sender_defaults(defaults)
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
              special_kwargs: SpecialKwargs,
              options: Optional[list[Optional[OptionsFn]]] = None,
              defaults: Optional[dict] = None) -> list[JoinResult]:
    """Runs one join per prompt, all at once, on an in-process engine.

    Args:
        engine: A stock `LLMEngine`.
        prompts: The prompts, as token ids.
        max_tokens: Each request's budget.
        special_kwargs: The hook configuration, resolved to ids.
        options: Per prompt, its extra options per sequence and segment.
        defaults: `SamplingParams` arguments of every request.

    Returns:
        The results, in prompt order.
    """
    sender = EngineSender(engine, defaults)
    tokenizer = engine.get_tokenizer()
    max_model_len = engine.model_config.max_model_len
    options = options or [None] * len(prompts)
    tasks = [
        JoinTask(f"join-{i}-{id(sender)}", prompt, max_tokens, special_kwargs,
                 max_model_len, tokenizer, sender, task_options)
        for i, (prompt, task_options) in enumerate(zip(prompts, options))
    ]
    sender.run(tasks)
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
