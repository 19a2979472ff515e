# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The promise/sync contract as a plain model, to check the coordinator by.

`ReferenceEngine` takes the same events as `FakeEngine` and says what a
correct engine holds after each: every live member's tokens, which are
parked, the children forked (with id, seed, budget, minimum and stop
strings), the members aborted and the trees reported. It is written from
docs/sequence-hooks.md, not from `sequence_hooks.lifecycle`: it shares no
code with the coordinator but the tokenizer of the fake engine and the
tree's JSON form.
"""

import hashlib
from dataclasses import dataclass, field
from typing import Optional

from fake_engine import (PROMISE, ROLE, SYNC, CharTokenizer, FakeLogprob,
                         sampled_logprob)

from sequence_hooks.actions import Fork, RequestParams


def seed_for(seed: int, purpose: str) -> int:
    """The documented derivation: blake2b-64 of "<seed>:<purpose>", little
    endian, shifted right once."""
    digest = hashlib.blake2b(f"{seed}:{purpose}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


@dataclass(eq=False)
class RefRequest:
    """A request: its tree, once it has promised."""

    request_id: str
    params: RequestParams
    logprobs: bool
    # Whether it has a tree (it sampled `<promise>`).
    tracked: bool = False
    spawned: int = 0
    refused: int = 0
    nodes: list["RefNode"] = field(default_factory=list)
    # Reported, aborted or finished.
    done: bool = False


@dataclass(eq=False)
class RefNode:
    """A member: what it holds and what its node will show."""

    request_id: str
    request: RefRequest
    parent: Optional["RefNode"]
    depth: int
    tokens: list[int]
    start: int
    seed: Optional[int]
    fork_position: Optional[int] = None
    children: list["RefNode"] = field(default_factory=list)
    num_merged: int = 0
    spans: list[tuple[int, int]] = field(default_factory=list)
    logprobs: list[FakeLogprob] = field(default_factory=list)
    parked_length: Optional[int] = None
    # "stop", "length" or "abort" in the tree.
    finish: Optional[str] = None
    # Finished by the engine, not reported yet.
    stopped: Optional[str] = None
    # Whether the engine holds it.
    in_engine: bool = True
    own: list[int] = field(default_factory=list)
    text: str = ""
    node_logprobs: Optional[list] = None
    cumulative: Optional[float] = None


class ReferenceEngine:
    """What an engine running the contract holds, event by event."""

    def __init__(self, limits: dict, max_model_len: int, reseeds: bool):
        self.limits = {
            "max_children_per_sequence": 16,
            "max_children_per_request": 64,
            "max_depth": 2,
            **limits
        }
        self.max_model_len = max_model_len
        self.reseeds = reseeds
        self.tokenizer = CharTokenizer()
        self.nodes: dict[str, RefNode] = {}
        self.requests: dict[str, RefRequest] = {}
        self.forks: list[Fork] = []
        self.resume_seeds: list[tuple[str, Optional[int]]] = []
        self.aborts: list[list[str]] = []
        self.reports: dict[str, dict] = {}

    # Events.

    def add_request(self, request_id: str, prompt: list[int],
                    params: RequestParams, logprobs: bool) -> None:
        request = RefRequest(request_id, params, logprobs)
        self.requests[request_id] = request
        root = RefNode(request_id, request, None, 0, list(prompt), len(prompt),
                       params.seed)
        request.nodes.append(root)
        self.nodes[request_id] = root

    def sample(self, member_id: str, token: int) -> None:
        node = self.nodes[member_id]
        node.logprobs.append(
            FakeLogprob(sampled_logprob(token, len(node.tokens)), 1))
        node.tokens.append(token)
        if token == PROMISE:
            node.request.tracked = True
            self._promise(node)
        elif token == SYNC and node.request.tracked:
            pending = node.children[node.num_merged:]
            if pending and all(child.finish for child in pending):
                self._merge(node, len(node.tokens))
            elif pending:
                node.parked_length = len(node.tokens)

    def stop(self, member_id: str, reason: str) -> None:
        self.nodes[member_id].stopped = reason

    def report(self, member_id: str) -> None:
        node = self.nodes[member_id]
        node.in_engine = False
        if node.finish is not None or node.request.done:
            return
        if not node.request.tracked:
            node.finish = node.stopped
            node.request.done = True
            return
        self._abort_below(node)
        self._record(node, node.stopped)
        if node.parent is None:
            self.reports[member_id] = self._tree(node)
            node.request.done = True
            return
        parent = node.parent
        if (parent.parked_length is not None and parent.finish is None
                and all(child.finish
                        for child in parent.children[parent.num_merged:])):
            self._merge(parent, parent.parked_length)

    def abort_request(self, request_id: str) -> None:
        root = self.nodes[request_id]
        root.in_engine = False
        if root.request.tracked:
            self._abort_below(root)
        root.finish = "abort"
        root.parked_length = None
        root.request.done = True

    # The contract.

    def _promise(self, node: RefNode) -> None:
        request = node.request
        if (len(node.children) >= self.limits["max_children_per_sequence"]
                or request.spawned >= self.limits["max_children_per_request"]
                or node.depth >= self.limits["max_depth"]):
            request.refused += 1
            return
        child_id = f"{request.request_id}/promise-{request.spawned}"
        request.spawned += 1
        seed = (None if node.seed is None else seed_for(
            node.seed, f"child-{len(node.children)}"))
        child = RefNode(child_id,
                        request,
                        node,
                        node.depth + 1,
                        node.tokens + [ROLE],
                        len(node.tokens) + 1,
                        seed,
                        fork_position=len(node.tokens) - node.start)
        node.children.append(child)
        request.nodes.append(child)
        self.nodes[child_id] = child
        params = request.params
        self.forks.append(
            Fork(child_id, node.request_id, (ROLE, ), params.max_tokens,
                 params.min_tokens, seed, params.stop))

    def _merge(self, node: RefNode, length: int) -> None:
        children = node.children[node.num_merged:]
        node.num_merged = len(node.children)
        node.parked_length = None
        text = "\n".join(child.text for child in children)
        room = self.max_model_len - length
        if node.request.params.max_tokens is not None:
            room = min(room,
                       node.request.params.max_tokens - (length - node.start))
        merged = self.tokenizer.encode(text)[:max(room - 1, 0)]
        if merged:
            node.spans.append((length - node.start, len(merged)))
        node.tokens += merged
        node.logprobs += [FakeLogprob(0.0)] * len(merged)
        seed = (None if node.seed is None else seed_for(
            node.seed, f"resume-{node.num_merged}"))
        # A resume carries a seed only to an engine that reseeds.
        self.resume_seeds.append(
            (node.request_id, seed if self.reseeds else None))
        if self.reseeds:
            node.seed = seed

    def _abort_below(self, node: RefNode) -> None:
        doomed = self._live_below(node)
        for member in doomed:
            member.finish = "abort"
            member.parked_length = None
        engine_aborts = [m.request_id for m in doomed if m.stopped is None]
        for member in doomed:
            if member.stopped is None:
                member.in_engine = False
        if engine_aborts:
            self.aborts.append(engine_aborts)

    def _live_below(self, node: RefNode) -> list[RefNode]:
        found = []
        for child in node.children:
            found += self._live_below(child)
            if child.finish is None:
                found.append(child)
        return found

    def _record(self, node: RefNode, reason: str) -> None:
        node.finish = reason
        node.own = node.tokens[node.start:]
        node.text = self.tokenizer.decode(node.own, False)
        if node.request.logprobs:
            merged = {
                i
                for start, count in node.spans
                for i in range(start, start + count)
            }
            node.node_logprobs = [
                None if i in merged else entry
                for i, entry in enumerate(node.logprobs)
            ]
            node.cumulative = sum(entry.logprob for entry in node.node_logprobs
                                  if entry is not None)

    def _tree(self, node: RefNode) -> dict:
        return {
            "request_id":
            node.request_id,
            "depth":
            node.depth,
            "fork_position":
            node.fork_position,
            "text":
            node.text,
            "token_ids":
            node.own,
            "finish_reason":
            node.finish,
            "num_merged_tokens":
            sum(count for _, count in node.spans),
            "merged_spans": [list(span) for span in node.spans],
            "logprobs":
            None if node.node_logprobs is None else [
                None if entry is None else entry.logprob
                for entry in node.node_logprobs
            ],
            "cumulative_logprob":
            node.cumulative,
            # Promise/sync names no branch.
            "label":
            None,
            "children": [self._tree(child) for child in node.children],
        }

    # What the engine should hold now.

    def live(self) -> set[str]:
        return {i for i, node in self.nodes.items() if node.in_engine}

    def runnable(self) -> list[str]:
        """Members that may sample: held, not parked, not stopped."""
        return sorted(i for i, node in self.nodes.items() if node.in_engine
                      and node.parked_length is None and node.stopped is None)

    def has_room(self, member_id: str) -> bool:
        node = self.nodes[member_id]
        max_tokens = node.request.params.max_tokens
        return (len(node.tokens) < self.max_model_len
                and (max_tokens is None
                     or len(node.tokens) - node.start < max_tokens))

    def parked(self) -> set[str]:
        return {
            i
            for i, node in self.nodes.items()
            if node.in_engine and node.parked_length is not None
        }

    def on_critical_path(self, member_id: str) -> bool:
        node = self.nodes[member_id]
        if not node.request.tracked or node.request.done:
            return False
        return node.num_merged > 0 or (node.parent is not None and
                                       node.parent.parked_length is not None)

    def live_tree_nodes(self) -> list[RefNode]:
        return [
            node for request in self.requests.values()
            if request.tracked and not request.done for node in request.nodes
        ]

    def children_running(self) -> int:
        return sum(1 for node in self.live_tree_nodes()
                   if node.parent is not None and node.finish is None)

    def spawned(self) -> int:
        return sum(request.spawned for request in self.requests.values())

    def refused(self) -> int:
        return sum(request.refused for request in self.requests.values())
