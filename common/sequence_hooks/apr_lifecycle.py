# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""APR's lifecycle (`sequence_hooks.apr`): the calls its controller makes,
made in-engine, each with the token ids the controller would send.

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
  cut rewrites text already sampled.

Each node's tokens in the tree are its trace re-tokenized, with the
logprobs its calls sampled them with where the ids agree
(`sequence_hooks.call_logprobs`).

Every request is a tree's root from its arrival. Records, aborts and
trees are the promise/sync lifecycle's.
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional

from sequence_hooks.actions import (Abort, Action, EngineQueries, MemberResult,
                                    ReportTree, RequestParams, Restart,
                                    StartTree)
from sequence_hooks.apr import (CALLING, MALFORMED, SUB_SEARCHES, APRFormat,
                                Node, call_trace, calls_sub_searches,
                                child_budget, cut_trace, ended_trace,
                                joined_trace, search_result, sub_searches)
from sequence_hooks.call_logprobs import CallTokens
from sequence_hooks.lifecycle import PromiseCoordinator
from sequence_hooks.members import Member
from sequence_hooks.special_kwargs import SpecialKwargs


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


class APRCoordinator(PromiseCoordinator):
    """Every decision of one engine's APR searches.

    Args:
        apr_format: The format for the engine's tokenizer.
        special_kwargs: The limits (`max_children_per_sequence` caps the
            children of one call; the rest are reported "No Solution").
        queries: What the coordinator asks the engine (read-only).
        max_model_len: The engine's longest sequence.
        metrics: `SequenceHookMetrics` to update; None: none.
    """

    trees_start_at_arrival = True

    def __init__(self,
                 apr_format: APRFormat,
                 special_kwargs: SpecialKwargs,
                 queries: EngineQueries,
                 max_model_len: int,
                 metrics=None):
        super().__init__(special_kwargs, queries, max_model_len, (), metrics)
        self.format = apr_format
        self._calls: dict[str, _Call] = {}
        self._searches: dict[str, _Search] = {}
        # Per root: its prompt's text as the controller's prefix, and ids.
        self._prompts: dict[str, tuple[str, list[int]]] = {}
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
        if member_id in self._members:
            return []
        member = self._track_root(member_id, params)
        prefix = self.format.prefix_of(prompt_token_ids)
        self._prompts[member_id] = (prefix, list(prompt_token_ids))
        self._calls[member_id] = _Call(prefix,
                                       CallTokens.prompt(prompt_token_ids))
        return [StartTree(member_id, member.tree.state, holds_output=True)]

    def own_start(self, member_id: str) -> int:
        """Where the member's current call's sampled tokens start."""
        call = self._calls.get(member_id)
        return call.start if call is not None else super().own_start(member_id)

    def sampled(self, member_id: str, token_id: int, length: int,
                params) -> list[Action]:
        """A member sampled ``token_id``: if its call's text now holds the
        controller's stop string, the call restarts with the text cut
        there and `<Calling Sub Searches>` (the controller's rewrite).

        Returns:
            The member's `Restart`, or none; past the context window, the
            member's end (`_restart`) and then `Abort` of its call, which
            still runs.
        """
        call = self._calls.get(member_id)
        if call is None or token_id not in self._closing:
            return []
        sampled = self.queries.token_ids(member_id)[call.start:]
        tail = self.format.decode(sampled[-len(SUB_SEARCHES):])
        if SUB_SEARCHES not in tail:
            return []
        text = self.format.decode(sampled)
        text = text[:text.index(SUB_SEARCHES)]
        actions = self._restart(
            member_id,
            call_trace(self.format.bos_token, call.prefix, text) + CALLING,
            call.prompt.sampled(sampled,
                                self.queries.sampled_logprobs(member_id)))
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
            The children's `Fork`s, or the root's `Restart` (no child
            listed), or the promise/sync lifecycle's actions at an end
            (a root's `ReportTree` with its output).
        """
        call = self._calls.pop(member_id, None)
        member = self._members.get(member_id)
        if call is None or member is None:
            return []
        text = (result.text if result.text is not None else self.format.decode(
            list(result.token_ids)))
        trace = ended_trace(
            call_trace(self.format.bos_token, call.prefix, text))
        # The stop id that ended the call (EOS) ends the output too, as a
        # stock request's does (the frontend does not detokenize it).
        ids = list(result.token_ids)
        tokens = call.prompt.sampled(ids, result.logprobs)
        stop = tuple(ids[-1:]) if reason == "stop" and ids and (
            ids[-1] == self.format.eos_token_id) else ()
        if member.node.parent is None and calls_sub_searches(trace):
            try:
                nodes = sub_searches(trace)
            except MALFORMED:
                # The reference gives up on the search, with this trace.
                return self._end(member, reason, trace, tokens, stop)
            return self._call(member, trace, nodes, tokens)
        return self._end(member, reason, trace, tokens, stop)

    def _call(self, member: Member, trace: str, nodes: list[Node],
              tokens: CallTokens) -> list[Action]:
        """Forks a root's sub-searches, each from its fresh prompt."""
        root_id = member.node.request_id
        limit = self.special_kwargs.fork_limit(member.tree.state.num_spawned)
        member.tree.state.num_refused += max(len(nodes) - limit, 0)
        self._searches[root_id] = _Search(trace, nodes, tokens)
        at = self._own_length(root_id, cut_trace(trace))
        budget = child_budget(self.format.budget, len(nodes),
                              self.format.avg_sub_call)
        actions: list[Action] = []
        for node in nodes[:limit]:
            prefix = node.prefix(budget)
            prompt = tuple(self.format.prompt_ids(prefix))
            # Each call has the request's budget and seed.
            fork = self._fork(member,
                              member.start + at,
                              prompt,
                              member.seed,
                              member.tree.params.max_tokens,
                              label=node.node)
            fork = dataclasses.replace(fork, fresh=True)
            self._members[fork.request_id].start = len(prompt)
            self._calls[fork.request_id] = _Call(prefix,
                                                 CallTokens.prompt(prompt))
            actions.append(fork)
        if not actions:
            return self._join(member)
        # The root's call has ended in the engine: its park is a record.
        self._park(member, member.start + at)
        return actions

    def _merge(self, member: Member, length: int) -> list[Action]:
        """All sub-searches have finished: the root's joined call."""
        return self._join(member)

    def _join(self, member: Member) -> list[Action]:
        tree, node = member.tree.state, member.node
        children = tree.take_unmerged(node)
        self._unpark(node)
        search = self._searches.pop(node.request_id)
        results: list[Optional[str]] = [
            search_result(child.text or "") for child in children
        ]
        results += [None] * (len(search.nodes) - len(results))
        joined = joined_trace(search.trace, search.nodes, results)
        at = self._own_length(node.request_id, cut_trace(search.trace))
        count = self._own_length(node.request_id, joined) - at
        tree.record_merged_tokens(node, at, count)
        self.metrics.merged_tokens.inc(count)
        return self._restart(node.request_id, joined, search.tokens)

    def _restart(self, member_id: str, trace: str,
                 tokens: CallTokens) -> list[Action]:
        """The member's next call, from ``trace``, after the call whose
        ids are ``tokens``: past the context window (a call the
        controller's server would refuse), the member ends there instead,
        finish "length"."""
        prompt = self.format.prompt_ids(trace)
        if len(prompt) >= self.max_model_len:
            return self._end(self._members[member_id], "length", trace, tokens)
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
            return super().finished(
                member_id, reason,
                MemberResult(
                    own, trace,
                    tokens.logprobs_of(self.format.prompt_ids(""), own)))
        prefix, prompt = self._prompts.pop(member_id)
        text = trace[len(prefix):] if trace.startswith(prefix) else trace
        own = [*self.format.encode_text(text), *stop]
        actions = super().finished(
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

    def _forget(self, member: Member) -> None:
        root_id = member.tree.state.root.request_id
        for member_id in member.tree.member_ids:
            self._calls.pop(member_id, None)
        self._searches.pop(root_id, None)
        self._prompts.pop(root_id, None)
        super()._forget(member)
