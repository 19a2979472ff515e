# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler's side of a join that splices its paths' KV (formats
trained with per-path positions, `sequence_hooks.splice_join`).

- Positions: each member whose positions leave its token indices has a
  position map (`splice_step.PositionMap`), the model runners a copy.
  A path's is its parent's with a shifted piece from its header on.
- Prefix cache: blocks holding KV at moved positions, or spliced, must
  never be another request's prefix hit. From the first moved index on,
  a member's block hashes are salted with a value of its own (its
  request's `_block_hasher` wrapped, upstream's hashes kept before).
- A path that ends keeps its blocks (one reference of ours) until its
  join takes them, or its tree ends. So that upstream's own finish of a
  path at the token after its newline (an EOS, a stop id, its length)
  frees none of them, a path given its newline (`closing`) is held
  (`hold`) across upstream's updates (`settle_held`) until it ends.
- The join: the parked member's blocks become its first path's (which
  hold its context, the goal's closing tag and that path), the later
  paths' tokens are copied token by token after them into fresh blocks,
  its position map gains each path's pieces and the closing tokens'
  (one past the highest path anchor), and its computed count covers all
  but the closing tokens, which its resume computes. The later paths'
  blocks are freed once the step carrying the copies has run.

Reaches into upstream's KV cache manager (`req_to_blocks`,
`num_cached_block`, `BlockPool.touch`/`get_new_blocks`/`free_blocks`) and
`Request._block_hasher`: tripwires in `seams_scheduler`.
"""

import hashlib
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from vllm_sequence_hooks.splice_step import (STEP_ATTRIBUTE, PositionMap,
                                             SpliceStep, deltas)

from sequence_hooks.actions import Splice
from vllm.config import VllmConfig
from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request

# The workers that splice, by the worker the platform picked.
SPLICE_WORKERS = {
    "vllm.v1.worker.cpu_worker.CPUWorker":
    "vllm_sequence_hooks.splice_runner.SpliceCPUWorker",
}
ROOT_MAP: PositionMap = ((0, 0), )


def use_splice_worker(vllm_config: VllmConfig) -> None:
    """Checks that an engine can splice KV and names the worker that does.

    Args:
        vllm_config: The engine's configuration, its worker resolved.

    Raises:
        ValueError: for what a splice cannot serve exactly.
    """
    refusals = {
        "M-RoPE models (positions of several axes)":
        vllm_config.model_config.uses_mrope,
        "sliding-window attention (windows count indices, not positions)":
        vllm_config.model_config.get_sliding_window() is not None,
        "KV connectors (they share blocks by hash)":
        vllm_config.kv_transfer_config is not None,
        "a quantized KV cache":
        vllm_config.cache_config.cache_dtype not in ("auto", None),
        "decode context parallelism":
        vllm_config.parallel_config.decode_context_parallel_size > 1,
    }
    for what, refused in refusals.items():
        if refused:
            raise ValueError(f"special_kwargs: a format that splices KV "
                             f"does not support {what}")
    parallel = vllm_config.parallel_config
    if parallel.worker_cls in SPLICE_WORKERS.values():
        return
    if parallel.worker_cls not in SPLICE_WORKERS:
        raise ValueError(f"special_kwargs: a format that splices KV runs on "
                         f"the workers whose KV layout it knows "
                         f"({', '.join(SPLICE_WORKERS)}), not "
                         f"{parallel.worker_cls}")
    parallel.worker_cls = SPLICE_WORKERS[parallel.worker_cls]


def salted_hasher(upstream: Callable[[Request],
                                     list[bytes]], boundary: int, salt: bytes,
                  block_size: int) -> Callable[[Request], list[bytes]]:
    """Upstream's block hasher, each hash of a block that ends after
    ``boundary`` salted (a chain no other request computes).

    Args:
        upstream: The request's hasher.
        boundary: The first index whose KV is not a plain prefix's.
        salt: The member's own salt.
        block_size: The hashes' block size.

    Returns:
        The hasher.
    """

    def salted(index: int, block_hash: bytes) -> bytes:
        if (index + 1) * block_size <= boundary:
            return block_hash
        return hashlib.sha256(salt + block_hash).digest()

    def hasher(request: Request) -> list[bytes]:
        first = len(request.block_hashes)
        return [
            salted(first + i, block_hash)
            for i, block_hash in enumerate(upstream(request))
        ]

    return hasher


@dataclass
class _Retained:
    """A finished path's blocks (one reference of ours each), tokens and
    position map, until its join."""

    root_id: str
    blocks: list[Any]
    token_ids: list[int]
    position_map: PositionMap


@dataclass
class _Copies:
    """A join's block work that no step has carried to the model runners
    yet."""

    # Its fresh blocks, zeroed first.
    zero_blocks: list[int]
    # ``(source block, offset, destination block, offset)``.
    token_copies: list[tuple[int, int, int, int]]
    # The later paths' blocks the copies read: freed once they ran.
    sources: list[Any]


@dataclass
class Splicing:
    """Splice joins on one V1 scheduler.

    Args:
        scheduler: The `SequenceHookScheduler`.
    """

    scheduler: Any
    # Members' position maps (a member without one follows its indices).
    maps: dict[str, PositionMap] = field(default_factory=dict)
    # Members whose hashes are salted, from which index.
    _salted: dict[str, int] = field(default_factory=dict)
    _retained: dict[str, _Retained] = field(default_factory=dict)
    # Maps new or changed since the last step with work, by member.
    _new_maps: dict[str, PositionMap] = field(default_factory=dict)
    # Joins whose copies no step has carried yet, by joined member.
    _copies: dict[str, _Copies] = field(default_factory=dict)
    # Per step in flight carrying copies, the blocks freed once it ran.
    _in_flight: dict[int, list[Any]] = field(default_factory=dict)
    # Paths given their newline, whose next token ends them.
    _closing: set[str] = field(default_factory=set)
    # Paths held across upstream's update, with their blocks.
    _held: dict[str, tuple[Request, list[Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        manager = self.scheduler.kv_cache_manager
        groups = manager.coordinator.single_type_managers
        if len(groups) != 1:
            raise ValueError("special_kwargs: a format that splices KV "
                             "needs one KV cache group (full attention in "
                             f"every layer); this model has {len(groups)}")

    def forked(self, child: Request, parent: Request,
               shift: tuple[int, int]) -> None:
        """A path forked: its map; its and its parent's hashes salted
        from the goal's closing tag on.

        Args:
            child: Its request (not scheduled yet).
            parent: Its parent's, its goal's closing tag last.
            shift: ``(k, shift)`` of its `Fork`.
        """
        first, moved = shift
        parent_map = self.maps.get(parent.request_id, ROOT_MAP)
        parent_len = parent.num_tokens
        self._set_map(child.request_id,
                      (*parent_map,
                       (parent_len + first, parent_map[-1][1] + moved)))
        self._salt(parent, parent_len - 1)
        self._salt(child, parent_len - 1)

    def retain(self, path: Request, root_id: str) -> None:
        """A path ends: keeps its blocks for its join.

        Args:
            path: Its request, before upstream frees it.
            root_id: Its tree's root.
        """
        manager = self.scheduler.kv_cache_manager
        (blocks, ) = manager.get_blocks(path.request_id).blocks
        manager.block_pool.touch(blocks)
        self._keep(path, root_id, list(blocks))

    def closing(self, path_id: str) -> None:
        """A path got tokens appended (its newline): its next token ends
        it, whatever ends it; it is held across each update until then.

        Args:
            path_id: Its request id.
        """
        self._closing.add(path_id)

    def hold(self, scheduled: dict[str, Request]) -> None:
        """Before upstream's update of a step: one reference of ours on
        each closing path's blocks, so that a path upstream finishes
        keeps them (`settle_held`).

        Args:
            scheduled: The step's scheduled members, by request id.
        """
        manager = self.scheduler.kv_cache_manager
        for path_id in self._closing & scheduled.keys():
            path = scheduled[path_id]
            (blocks, ) = manager.get_blocks(path.request_id).blocks
            manager.block_pool.touch(blocks)
            self._held[path.request_id] = (path, list(blocks))

    def settle_held(self, root_of: Callable[[str], Any]) -> None:
        """After upstream's update: a held path that upstream finished
        keeps its blocks for its join (`retain`'s reference); the others'
        holds are dropped.

        Args:
            root_of: A member's tree's root id.
        """
        pool = self.scheduler.kv_cache_manager.block_pool
        held, self._held = self._held, {}
        for path_id, (path, blocks) in held.items():
            root_id = root_of(path_id)
            if path.is_finished() and root_id is not None:
                self._closing.discard(path_id)
                self._keep(path, root_id, blocks)
            else:
                pool.free_blocks(reversed(blocks))

    def _keep(self, path: Request, root_id: str, blocks: list[Any]) -> None:
        """Keeps a path's blocks (one reference of ours each), its
        computed tokens and its map until its join or its tree's end."""
        self._retained[path.request_id] = _Retained(
            root_id, blocks,
            list(path.all_token_ids[:path.num_computed_tokens]),
            self.maps.get(path.request_id, ROOT_MAP))

    def join(self, parent: Request, splice: Splice,
             resume: Callable[[list[int], bool], None]) -> list[int]:
        """Carries out a splice join on a parked member.

        With too few free blocks for the join's fresh ones (those the
        copied paths and the closing tag fill), the member is computed
        again from its joined tokens instead, as a preempted spliced
        member is (docs/formats.md): a join never fails and never waits
        for blocks that only its own next step would free.

        Args:
            parent: Its request (parked: its goal's closing tag sampled,
                not computed).
            splice: The action.
            resume: Appends tokens as its session's next chunk (its
                parking's resume), and whether its blocks were freed.

        Returns:
            The tokens appended after the closing tag.
        """
        frontier = parent.num_computed_tokens
        paths = [self._retained.pop(p.member_id) for p in splice.paths]
        if splice.paths[0].start != frontier:
            raise AssertionError(f"splice of {parent.request_id}: its first "
                                 f"path starts at {splice.paths[0].start}, "
                                 f"its computed tokens end at {frontier}")
        block_size = self.scheduler.block_size
        position_map = [
            piece for piece in self.maps.get(parent.request_id, ROOT_MAP)
            if piece[0] < frontier
        ]
        token_ids: list[int] = []
        copies, anchors = [], []
        at = frontier
        for i, (path, kept) in enumerate(zip(splice.paths, paths)):
            offset = at - path.start
            for start, delta in _pieces_within(kept.position_map, path.start,
                                               path.end):
                position_map.append((start + offset, delta - offset))
            anchors.append(path.anchor +
                           _delta_at(kept.position_map, path.anchor))
            token_ids += kept.token_ids[path.start:path.end]
            if i:
                copies += [(kept.blocks[c // block_size].block_id,
                            c % block_size, c + offset)
                           for c in range(path.start, path.end)]
            at += path.end - path.start
        closing = list(splice.closing_token_ids)
        position_map.append((at, max(anchors) + 1 - at))
        appended = token_ids[1:] + closing
        self._set_map(parent.request_id, tuple(position_map))
        manager = self.scheduler.kv_cache_manager
        # Room for the closing tag too: its step needs no block that only
        # the copies' landing frees.
        fresh = max(
            cdiv(at + len(closing), block_size) - len(paths[0].blocks), 0)
        (held, ) = manager.get_blocks(parent.request_id).blocks
        # The parent's blocks that no one else holds are free once it
        # adopts the first path's.
        freed = sum(block.ref_cnt == 1 for block in held)
        if fresh > manager.block_pool.get_num_free_blocks() + freed:
            manager.free(parent)
            for kept in paths:
                manager.block_pool.free_blocks(reversed(kept.blocks))
            resume(appended, True)
            return appended
        resume(appended, False)
        self._adopt(parent, paths[0].blocks, fresh, copies,
                    [block for kept in paths[1:] for block in kept.blocks])
        parent.num_computed_tokens = at
        return appended

    def _adopt(self, parent: Request, blocks: list[Any], fresh: int,
               copies: list[tuple[int, int, int]], sources: list[Any]) -> None:
        """The parent's blocks become ``blocks`` (our references moved to
        it) and ``fresh`` new ones, which ``copies`` fill from
        ``sources``."""
        manager = self.scheduler.kv_cache_manager
        (group, ) = manager.coordinator.single_type_managers
        manager.free(parent)
        block_size = self.scheduler.block_size
        table = [*blocks, *manager.block_pool.get_new_blocks(fresh)]
        group.req_to_blocks[parent.request_id] = table
        cached = 0
        while cached < len(table) and table[cached].block_hash is not None:
            cached += 1
        group.num_cached_block[parent.request_id] = cached
        self._copies[parent.request_id] = _Copies(
            [block.block_id for block in table[len(blocks):]],
            [(src, src_offset, table[dst // block_size].block_id,
              dst % block_size) for src, src_offset, dst in copies], sources)

    def release_root(self, root_id: str) -> None:
        """A tree ended: frees its paths' blocks no join took."""
        pool = self.scheduler.kv_cache_manager.block_pool
        for path_id, kept in list(self._retained.items()):
            if kept.root_id == root_id:
                del self._retained[path_id]
                pool.free_blocks(reversed(kept.blocks))

    def forget(self, request_id: str) -> None:
        """A member's request ended for good: its map and salt go, and a
        join's copies no step carried yet (its blocks are freed: copies
        into them would write blocks that may be another's now)."""
        self.maps.pop(request_id, None)
        self._new_maps.pop(request_id, None)
        self._salted.pop(request_id, None)
        self._closing.discard(request_id)
        copies = self._copies.pop(request_id, None)
        if copies is not None:
            self.scheduler.kv_cache_manager.block_pool.free_blocks(
                copies.sources)

    def scheduled(self, scheduler_output: SchedulerOutput) -> None:
        """Gives a step with work what the model runners are due."""
        if not (self._new_maps or self._copies
                ) or not scheduler_output.total_num_scheduled_tokens:
            return
        copies = list(self._copies.values())
        setattr(
            scheduler_output, STEP_ATTRIBUTE,
            SpliceStep(self._new_maps,
                       [block for c in copies for block in c.zero_blocks],
                       [copy for c in copies for copy in c.token_copies]))
        self._new_maps, self._copies = {}, {}
        if copies:
            self._in_flight[id(scheduler_output)] = [
                block for c in copies for block in c.sources
            ]

    def landed(self, scheduler_output: SchedulerOutput) -> None:
        """A step ran: the blocks its copies read are freed."""
        blocks = self._in_flight.pop(id(scheduler_output), None)
        if blocks:
            self.scheduler.kv_cache_manager.block_pool.free_blocks(blocks)

    def _set_map(self, request_id: str, position_map: PositionMap) -> None:
        self.maps[request_id] = position_map
        self._new_maps[request_id] = position_map

    def _salt(self, request: Request, boundary: int) -> None:
        """Salts a member's block hashes from ``boundary`` on (kept from
        where it was salted first)."""
        if request.request_id in self._salted:
            return
        self._salted[request.request_id] = boundary
        block_size = self.scheduler.hash_block_size
        request._block_hasher = salted_hasher(request._block_hasher, boundary,
                                              secrets.token_bytes(16),
                                              block_size)
        del request.block_hashes[boundary // block_size:]
        request.update_block_hashes()


def _delta_at(position_map: PositionMap, index: int) -> int:
    """An index's delta by a map."""
    return int(deltas(position_map, np.array([index]))[0])


def _pieces_within(position_map: PositionMap, start: int,
                   end: int) -> list[tuple[int, int]]:
    """A map's pieces over ``[start, end)``, the first one from
    ``start``."""
    pieces = [(start, _delta_at(position_map, start))]
    pieces += [(s, d) for s, d in position_map if start < s < end]
    return pieces
