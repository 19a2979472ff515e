# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""APR's format (docs/formats.md): a search calls sub-searches in its
text, each starts from a fresh prompt, and their results are joined as
text into the search cut back to before its call; the engine makes the
calls its controller makes, each with the token ids the controller would
send.

The trace grammar is read from Parallel-Reasoning/APR,
src/eval/parallel_infernce_utils.py (`get_subsearch_info`,
`get_search_result`, `get_main_trace_after_sub_search`) and
src/eval/eval_apr.py (`generate`, `decode_trace`), written anew; lists
in the trace are read with ``ast.literal_eval`` where the reference uses
``eval``.

APR's controller works in text: every call is a text prompt (the BOS as
text, then the trace so far) that the server tokenizes anew. So the
engine cannot extend a member's tokens; it restarts the member's call
(`Restart`) with the re-tokenized trace, and a prefix cache keeps the KV
the two share:

- A member whose text reaches `<Sub Searches>` (the controller's stop
  string) restarts with that text cut there and `<Calling Sub Searches>`.
- A root whose call ends with a call of sub-searches forks one child per
  listed node, each from a fresh prompt (`Fork.fresh`), and waits; once
  all have finished it restarts with its trace cut back to before the
  call and the children's results (`joined_trace`).
- Anything else ends the member; a root's output is its final trace after
  its prompt, held back until then (`StartTree.holds_output`), since a
  cut rewrites text already sampled. So does a call the reference gives
  up on (any error reading it), and a call its search made before (a
  join that cut back into text it had sent): the reference would repeat
  it forever under greedy decoding.

Each node's tokens in the tree are its trace re-tokenized, with the
logprobs its calls sampled them with where the ids agree
(`sequence_hooks.call_logprobs`). Every request is a tree's root from its
arrival.
"""

import ast
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from sequence_hooks.actions import (Abort, Action, MemberResult, ReportTree,
                                    RequestParams, Restart, StartTree)
from sequence_hooks.call_logprobs import CallTokens
from sequence_hooks.formats import (ARRIVALS, FRESH_CHILDREN, HELD_OUTPUT,
                                    RESTART, Format, FormatSetting)
from sequence_hooks.lifecycle import Coordinator, FormatPolicy
from sequence_hooks.members import Member

NAME = "apr"
CALL, CALL_END = "<Calling Sub Searches>\n", "<End Calling Sub Searches>"
# Never the model's to write: the controller writes CALLING in its place.
SUB_SEARCHES, CALLING = "<Sub Searches>", "<Calling Sub Searches>"
GOAL = "Goal Reached"


@dataclass(frozen=True)
class Node:
    """A search node a sub-search starts from."""

    node: str
    target: int
    nums: list[int]
    operations: list[str]

    def prefix(self, budget: Optional[int]) -> str:
        """The sub-search's prompt (without the BOS)."""
        text = (f"Moving to Node {self.node}\nCurrent State: {self.target}:"
                f"[{', '.join(map(str, self.nums))}], Operations: "
                f"{self.operations}")
        return text if budget is None else f"Token Budget: {budget} {text}"


def call_trace(bos_token: str, prefix: str, completion: str) -> str:
    """A call's trace as the reference's `generate` returns it: the BOS
    (sent as text) replaced by a space, one leading space dropped; with no
    BOS ("": the reference's replace would put a space between every two
    characters) the text as it is."""
    if not bos_token:
        return prefix + completion
    text = (bos_token + prefix + completion).replace(bos_token, " ")
    return text[1:] if text.startswith(" ") else text


def ended_trace(trace: str) -> str:
    """A trace at the end of `decode_trace`: an empty last line dropped."""
    return trace[:-1] if trace.split("\n")[-1] == "" else trace


def calls_sub_searches(trace: str) -> bool:
    """Whether the trace's last line ends a call of sub-searches."""
    return CALL_END in trace.split("\n")[-1]


def _nodes(trace: str) -> dict[str, Node]:
    """Every node the trace describes, by id."""
    nodes: dict[str, Node] = {}
    lines = trace.split("\n")
    for line, following in zip(lines, lines[1:]):
        if "Moving to Node #" in line and "Current State:" in following:
            node_id = line.split("Moving to Node #")[1].strip()
            state = following.split("Current State:")[1].split("],")[0]
            # The numbers up to a second colon, as the reference reads them.
            target, nums = state.strip().split(":")[:2]
            nodes[node_id] = Node(
                f"#{node_id}", int(target),
                ast.literal_eval(nums.strip() + "]"),
                ast.literal_eval(following.split("Operations:")[1].strip()))
    for line in lines:
        if "Generated Node" not in line:
            continue
        node_id = line.split(":")[0].split("#")[1]
        if node_id in nodes:
            continue
        rest = line.split(":", 1)[1].strip()
        state, operation = (part.strip()
                            for part in rest.split("Operation:")[:2])
        target, nums = state.split(":")[:2]
        parent = nodes[",".join(node_id.split(",")[:-1])]
        nodes[node_id] = Node(f"#{node_id}", int(target),
                              ast.literal_eval(nums.strip()),
                              parent.operations + [operation])
    return nodes


def sub_searches(trace: str) -> list[Node]:
    """The nodes the trace's last call lists, in order (the reference's
    `get_subsearch_info`).

    Raises:
        ValueError: the trace calls no sub-searches.
        Exception: a listed node the trace does not describe, or a
            malformed state (any error of reading it: `KeyError`,
            `SyntaxError`, `TypeError` for `Operations: None`...).
    """
    if not calls_sub_searches(trace):
        raise ValueError("the trace calls no sub-searches")
    nodes = _nodes(trace)
    section = trace.split(CALL)[-1].split("\n" + CALL_END)[0]
    return [
        nodes[line.split("Moving to Node #")[1].strip()]
        for line in section.split("\n")
        if "<Start Sub Search" in line and "Moving to Node" in line
    ]


def child_budget(budget: Optional[int], children: int,
                 avg_sub_call: bool) -> Optional[int]:
    """A child's ``Token Budget``: the whole, or with ``avg_sub_call`` its
    share rounded up to a multiple of 512 (a call listing no node has no
    child to share it)."""
    if not avg_sub_call or budget is None or not children:
        return budget
    return int((budget / children - 1) // 512 + 1) * 512


def search_result(trace: str) -> Optional[str]:
    """The winning path of a trace that reached the goal, else None."""
    if trace.count(GOAL) < 2:
        return None
    return trace[trace[:trace.rfind(GOAL)].rfind(GOAL):].strip()[13:]


def cut_trace(trace: str) -> str:
    """The trace cut back to before its last call."""
    return CALL.join(trace.split(CALL)[:-1])


def joined_trace(trace: str, nodes: list[Node],
                 results: list[Optional[str]]) -> str:
    """The parent cut back to before its last call, then the children's
    results (the reference's `get_main_trace_after_sub_search`)."""
    joined = cut_trace(trace) + "<Sub Searches>\n"
    for i, (node, result) in enumerate(zip(nodes, results)):
        if result is None:
            joined += (f"<No Solution in Sub Search {i} at level 1 at Node "
                       f"{node.node}>\n")
        else:
            joined += (f"<Goal Reached in Sub Search {i} at level 1 at Node "
                       f"{node.node}>\n{result}\n")
    return joined + "<End Sub Searches>\n"


@dataclass(frozen=True)
class APRFormat:
    """APR's format for one tokenizer: how the engine turns its text into
    the token ids APR's controller would send, and back.

    Args:
        bos_token: Sent as text before every prompt (the reference's
            ``ADD_BOS``); "" if the tokenizer has none.
        encode: A prompt's text to ids, as vLLM's completions API
            tokenizes a text prompt (special tokens added).
        decode: Sampled ids to text, as vLLM's detokenizer gives it
            (special tokens skipped).
        decode_prompt: Prompt ids to text, special tokens kept.
        encode_text: Text to ids, no special tokens added.
        eos_token_id: The end-of-sequence token.
        closing: Ids whose text holds the stop string's last character
            (the only tokens that can complete it).
        budget: The children's ``Token Budget`` prefix; None: none.
        avg_sub_call: Split ``budget`` among the children.
    """

    bos_token: str
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    decode_prompt: Callable[[list[int]], str]
    encode_text: Callable[[str], list[int]]
    eos_token_id: Optional[int]
    closing: frozenset[int]
    budget: Optional[int] = None
    avg_sub_call: bool = False

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> "APRFormat":
        """The format as vLLM's completions API runs it on ``tokenizer``
        (a Hugging Face tokenizer: `encode`, `decode`, `bos_token`,
        `convert_ids_to_tokens`)."""
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        return cls(
            tokenizer.bos_token or "", tokenizer.encode,
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
            lambda text: tokenizer.encode(text, add_special_tokens=False),
            tokenizer.eos_token_id,
            frozenset(i for i, piece in enumerate(pieces)
                      if piece and SUB_SEARCHES[-1] in piece))

    def prompt_ids(self, prefix: str) -> list[int]:
        """The ids of a call's prompt: the BOS and ``prefix``."""
        return self.encode(self.bos_token + prefix)

    def prefix_of(self, prompt_ids: list[int]) -> str:
        """A request's prompt as the controller's prefix: its text with
        the BOS it was sent with off."""
        text = self.decode_prompt(prompt_ids)
        if self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return call_trace(self.bos_token, "", text)


@dataclass(frozen=True)
class _Call:
    """A member's current call: the trace it was sent (no BOS) and its
    prompt's ids, with the logprobs they keep from earlier calls."""

    prefix: str
    prompt: CallTokens

    @property
    def start(self) -> int:
        """Where its sampled tokens start."""
        return len(self.prompt.ids)


@dataclass(frozen=True)
class _Search:
    """A root waiting for its sub-searches: its trace at the call, the
    nodes it listed (a child each, up to the per-tree limit) and its
    call's ids."""

    trace: str
    nodes: list[Node]
    tokens: CallTokens


class APRPolicy(FormatPolicy):
    """Every decision of one engine's APR searches.

    Args:
        coordinator: The coordinator it decides for (its
            `special_kwargs`' `max_children_per_sequence` caps the
            children of one call; the rest are reported "No Solution").
        apr_format: The format for the engine's tokenizer.
    """

    trees_start_at_arrival = True

    def __init__(self, coordinator: Coordinator,
                 apr_format: "APRFormat") -> None:
        super().__init__(coordinator)
        self.format = apr_format
        self._calls: dict[str, _Call] = {}
        self._searches: dict[str, _Search] = {}
        # Per root: its prompt's text as the controller's prefix, and ids.
        self._prompts: dict[str, tuple[str, list[int]]] = {}
        # Per root: the traces its calls of sub-searches ended with.
        self._called: dict[str, set[str]] = {}
        # Tokens whose text may end the controller's stop string.
        self._closing = apr_format.closing

    def arrived(self, member_id: str, prompt_token_ids: list[int],
                params: RequestParams) -> list[Action]:
        """A request arrived: it is a search's root (a restarted call of a
        member is no arrival).

        Args:
            member_id: Its request id.
            prompt_token_ids: Its prompt.
            params: Its parameters.

        Returns:
            Its `StartTree`, its output held; none for a member.
        """
        if self.coordinator.is_member(member_id):
            return []
        member = self.coordinator.track_root(member_id, params)
        prefix = self.format.prefix_of(prompt_token_ids)
        self._prompts[member_id] = (prefix, list(prompt_token_ids))
        self._calls[member_id] = _Call(prefix,
                                       CallTokens.prompt(prompt_token_ids))
        return [StartTree(member_id, member.tree.state, holds_output=True)]

    def own_start(self, member_id: str) -> Optional[int]:
        """Where the member's current call's sampled tokens start."""
        call = self._calls.get(member_id)
        return call.start if call is not None else None

    def sampled(self, member_id: str, token_ids: Sequence[int],
                params: Callable[[], RequestParams],
                logprobs: Optional[list]) -> list[Action]:
        """A member sampled a token: if its call's text now holds the
        controller's stop string, the call restarts with the text cut
        there and `<Calling Sub Searches>` (the controller's rewrite).

        Returns:
            The member's `Restart`, or none; past the context window, the
            member's end (`_restart`) and then `Abort` of its call, which
            still runs.
        """
        call = self._calls.get(member_id)
        if call is None or token_ids[-1] not in self._closing:
            return []
        sampled = list(token_ids[call.start:])
        # Text enough to hold the stop string ending in the last token;
        # more tokens while some have none (special tokens, skipped as
        # the controller's server skips them, inside the stop string).
        wanted = len(SUB_SEARCHES) + len(self.format.decode(sampled[-1:])) - 1
        count = len(SUB_SEARCHES)
        tail = self.format.decode(sampled[-count:])
        while len(tail) < wanted and count < len(sampled):
            count *= 2
            tail = self.format.decode(sampled[-count:])
        if SUB_SEARCHES not in tail:
            return []
        text = self.format.decode(sampled)
        text = text[:text.index(SUB_SEARCHES)]
        actions = self._restart(
            member_id,
            call_trace(self.format.bos_token, call.prefix, text) + CALLING,
            call.prompt.sampled(sampled, logprobs))
        if any(
                isinstance(action, Restart) and action.member_id == member_id
                for action in actions):
            return actions
        # The member ended mid-call: the engine ends the call (after the
        # end's report, which gives a held root's output from this step).
        self._calls.pop(member_id, None)
        return [*actions, Abort((member_id, ))]

    def finished(self, member_id: str, reason: str,
                 result: MemberResult) -> list[Action]:
        """A member's call ended: a root that calls sub-searches forks
        them; any other member ends with its trace.

        Args:
            member_id: The member.
            reason: "stop" or "length".
            result: The call's sampled tokens and their text.

        Returns:
            The children's `Fork`s, or the member's `Restart` (a root's
            call listing no child, or a call whose last token completed
            `<Sub Searches>`), or the promise/sync lifecycle's actions at
            an end (a root's `ReportTree` with its output).
        """
        call = self._calls.pop(member_id, None)
        member = self.coordinator.member(member_id)
        if call is None or member is None:
            return []
        text = (result.text if result.text is not None else self.format.decode(
            list(result.token_ids)))
        ids = list(result.token_ids)
        tokens = call.prompt.sampled(ids, result.logprobs)
        if SUB_SEARCHES in text:
            # Its last token completed the stop string (no `sampled` event
            # comes for a token that ends the call, at its budget): the
            # controller's server reports the stop, the controller
            # rewrites it.
            return self._restart(
                member_id,
                call_trace(self.format.bos_token, call.prefix,
                           text[:text.index(SUB_SEARCHES)]) + CALLING, tokens)
        trace = ended_trace(
            call_trace(self.format.bos_token, call.prefix, text))
        # The stop id that ended the call (EOS) ends the output too, as a
        # stock request's does (the frontend does not detokenize it).
        stop = tuple(ids[-1:]) if reason == "stop" and ids and (
            ids[-1] == self.format.eos_token_id) else ()
        if member.node.parent is None and calls_sub_searches(trace):
            called = self._called.setdefault(member_id, set())
            if trace in called:
                # The same call again (its join cut back into what it had
                # sent): the reference would make the same calls forever
                # under greedy decoding. The search ends here, with its
                # trace.
                return self._end(member, reason, trace, tokens, stop)
            called.add(trace)
            try:
                # The reference's `get_subsearch_info`: the nodes and
                # their prompts.
                nodes = sub_searches(trace)
                budget = child_budget(self.format.budget, len(nodes),
                                      self.format.avg_sub_call)
                prefixes = [node.prefix(budget) for node in nodes]
            except Exception:
                # The reference's `call_search` gives up on the search,
                # with this trace, whatever reading the call raised.
                return self._end(member, reason, trace, tokens, stop)
            return self._call(member, trace, nodes, prefixes, tokens)
        return self._end(member, reason, trace, tokens, stop)

    def _call(self, member: Member, trace: str, nodes: list[Node],
              prefixes: list[str], tokens: CallTokens) -> list[Action]:
        """Forks a root's sub-searches, each from its fresh prompt."""
        root_id = member.node.request_id
        coordinator = self.coordinator
        limit = coordinator.special_kwargs.fork_limit(
            member.tree.state.num_spawned)
        member.tree.state.num_refused += max(len(nodes) - limit, 0)
        self._searches[root_id] = _Search(trace, nodes, tokens)
        at = self._own_length(root_id, cut_trace(trace))
        actions: list[Action] = []
        for node, prefix in zip(nodes[:limit], prefixes):
            prompt = tuple(self.format.prompt_ids(prefix))
            # Each call has the request's budget and seed.
            fork = coordinator.fork(member,
                                    member.start + at,
                                    prompt,
                                    member.seed,
                                    member.tree.params.max_tokens,
                                    label=node.node,
                                    fresh=True)
            self._calls[fork.request_id] = _Call(prefix,
                                                 CallTokens.prompt(prompt))
            actions.append(fork)
        if not actions:
            return self._join(member)
        # The root's call has ended in the engine: its park is a record.
        coordinator.park(member, member.start + at)
        return actions

    def children_done(self, member: Member, length: int) -> list[Action]:
        """All sub-searches have finished: the root's joined call."""
        return self._join(member)

    def _join(self, member: Member) -> list[Action]:
        node = member.node
        children = self.coordinator.take_finished_children(member)
        search = self._searches.pop(node.request_id)
        results: list[Optional[str]] = [
            search_result(child.text or "") for child in children
        ]
        results += [None] * (len(search.nodes) - len(results))
        joined = joined_trace(search.trace, search.nodes, results)
        at = self._own_length(node.request_id, cut_trace(search.trace))
        count = self._own_length(node.request_id, joined) - at
        self.coordinator.record_merged(member, at, count)
        return self._restart(node.request_id, joined, search.tokens)

    def _restart(self, member_id: str, trace: str,
                 tokens: CallTokens) -> list[Action]:
        """The member's next call, from ``trace``, after the call whose
        ids are ``tokens``: past the context window (a call the
        controller's server would refuse), the member ends there instead,
        finish "length"."""
        prompt = self.format.prompt_ids(trace)
        if len(prompt) >= self.coordinator.max_model_len:
            return self._end(self.coordinator.member(member_id), "length",
                             trace, tokens)
        self._calls[member_id] = _Call(trace, tokens.carried_to(prompt))
        return [Restart(member_id, tuple(prompt))]

    def _end(self,
             member: Member,
             reason: str,
             trace: str,
             tokens: CallTokens,
             stop: tuple[int, ...] = ()) -> list[Action]:
        """Ends a member with its trace: a child's result, or a root's
        output (its trace after its prompt, then ``stop``: the stop id its
        last call ended at, if any); ``tokens``: its last call's ids."""
        member_id = member.node.request_id
        if member.node.parent is not None:
            # A sub-search's tokens in the tree: its final call's prompt
            # and what it sampled, re-tokenized as its trace (after the
            # BOS every call is sent with).
            own = self.format.encode_text(trace)
            return self.coordinator.end(
                member_id, reason,
                MemberResult(
                    own, trace,
                    tokens.logprobs_of(self.format.prompt_ids(""), own)))
        prefix, prompt = self._prompts.pop(member_id)
        text = trace[len(prefix):] if trace.startswith(prefix) else trace
        own = [*self.format.encode_text(text), *stop]
        actions = self.coordinator.end(
            member_id, reason,
            MemberResult(own, text, tokens.logprobs_of(prompt, own)))
        return [
            dataclasses.replace(action, output_token_ids=tuple(own))
            if isinstance(action, ReportTree) else action for action in actions
        ]

    def _own_length(self, root_id: str, trace: str) -> int:
        """Tokens of ``trace`` after its root's prompt."""
        return len(
            self.format.encode_text(trace[len(self._prompts[root_id][0]):]))

    def forget(self, member: Member) -> None:
        """Drops the search's calls, sub-searches and prompt."""
        root_id = member.tree.state.root.request_id
        for member_id in member.tree.member_ids:
            self._calls.pop(member_id, None)
        self._searches.pop(root_id, None)
        self._prompts.pop(root_id, None)
        self._called.pop(root_id, None)


def _policy(coordinator: Coordinator, setting: FormatSetting) -> APRPolicy:
    return APRPolicy(coordinator, APRFormat.for_tokenizer(setting.tokenizer))


FORMAT = Format(name=NAME,
                policy=_policy,
                needs=frozenset(
                    {RESTART, FRESH_CHILDREN, HELD_OUTPUT, ARRIVALS}),
                summary="searches call sub-searches in text, each from a "
                "fresh prompt, joined as text")
