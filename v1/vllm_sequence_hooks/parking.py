# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV cache mechanics of the V1 hooks: a child's fork, a parent's park, its
resume and its eviction under pressure.

- A new child's prefix-cache lookup is answered with its parent's blocks:
  full blocks are shared by reference count, the partly filled last block
  is copied (upstream's copy-on-write for partial prefix hits), so the
  child computes only what follows its parent's computed context.
- A parked parent is a streaming-input session between chunks: out of the
  running queue, its blocks and model-runner state kept, never scheduled,
  and not counted against `max_num_seqs` (it holds no row of the batch).
  Under async scheduling its next step is already in flight when its
  `<sync>` comes back: that step's work is dropped, as upstream drops a
  finished streaming turn's, and the park resumes from what is computed.
  Its resume is the session's next chunk.
- With nothing running, parked parents that hold the blocks the next
  request needs are evicted (blocks freed, the resume recomputes less what
  the prefix cache gives back), so a full cache never deadlocks.

It knows blocks, requests and queues, not trees: which members are
parked, evicted or forked from where is the hooks' (`members`), given
with each call.
"""

from collections.abc import Collection, Container, Mapping
from typing import Any, NamedTuple, Optional

from vllm_sequence_hooks.releases import for_installed

from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.request import Request, RequestStatus, StreamingUpdate


class ForkPoint(NamedTuple):
    """Where a child not admitted yet forked: its parent, and the tokens
    the parent had computed then (the child's prefix hit)."""

    parent_id: str
    num_shared: int


class KvParking:
    """The hooks' KV mechanics on one V1 scheduler.

    Args:
        scheduler: The `SequenceHookScheduler`.
    """

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        # What differs on the installed vLLM release.
        self.release = for_installed()

    def sessions(self, parked: Mapping[str, float]) -> dict[str, float]:
        """The parked members this scheduler holds as parked sessions
        (`park`). A format may park a member whose call has ended (a root
        while its fresh children run): it has no request here, and
        upstream never counted it.

        Args:
            parked: When each parked member was parked.

        Returns:
            Those of ``parked`` held as sessions, with when each was.
        """
        requests = self.scheduler.requests
        return {
            member_id: since
            for member_id, since in parked.items()
            if member_id in requests and requests[member_id].status ==
            RequestStatus.WAITING_FOR_STREAMING_REQ
        }

    def park(self, request: Request) -> None:
        """Parks a running request as a streaming session between chunks.

        With async scheduling, a step scheduled before the token that parks
        it came back is in flight: as upstream's `_handle_stopped_request`
        does for a streaming turn that ended, the request goes back to its
        computed frontier (the in-flight token's position is computed again
        at the resume) and the in-flight output is dropped when it arrives.
        Without async scheduling nothing is in flight and this changes
        nothing.

        Args:
            request: The running request.
        """
        scheduler = self.scheduler
        scheduler.running.remove(request)
        request.num_computed_tokens -= request.num_output_placeholders
        request.num_output_placeholders = 0
        request.spec_token_ids = []
        if request.num_in_flight_tokens:
            request.drop_stale_output = True
            request.num_stale_output_tokens = request.num_in_flight_tokens
        request.status = RequestStatus.WAITING_FOR_STREAMING_REQ
        scheduler.num_waiting_for_streaming_input += 1
        scheduler._enqueue_waiting_request(request)

    def resume(self, request: Request, token_ids: list[int],
               evicted: bool) -> None:
        """Appends a member's merged tokens as its session's next chunk:
        `<sync>` (sampled, not computed yet) and the merged tokens.

        Upstream keeps the computed tokens' KV and drops the uncomputed
        sampled token, given back here. The model runner keeps the
        request's generator: a seeded parent goes on with its own stream,
        replaying nothing.

        Args:
            request: The member's request (parked, or running: parked
                first, as only a session takes a next chunk).
            token_ids: The merged tokens.
            evicted: Whether its KV blocks were freed: its resume is then
                a new prefill of its whole context, queued as one.
        """
        if request.status == RequestStatus.RUNNING:
            self.park(request)
        sync_token = request.all_token_ids[request.num_computed_tokens:]
        # Output so far becomes prompt; the budget keeps counting it.
        max_tokens = (request.max_tokens - request.num_output_tokens -
                      len(token_ids))
        params = request.sampling_params
        params.prompt_logprobs = None
        self.release.update_request_as_session(
            self.scheduler, request,
            StreamingUpdate(mm_features=None,
                            prompt_token_ids=sync_token + token_ids,
                            max_tokens=max_tokens,
                            arrival_time=request.arrival_time,
                            sampling_params=params))
        if evicted:
            request.num_computed_tokens = 0
            self.release.kv_holding_queue(
                self.scheduler).remove_request(request)
            self.scheduler.waiting.prepend_request(request)

    def queue_fork(self, child: Request, parent: Request,
                   first: bool) -> ForkPoint:
        """Queues a new child; its prefix hit is ``parent``'s computed
        context: with async scheduling, less the positions of the steps in
        flight, whose KV the child computes itself.

        Args:
            child: The child's request.
            parent: Its parent's.
            first: Whether it goes ahead of new requests (it continues
                work already admitted), else where a new request goes.

        Returns:
            Where it forked, for its prefix hit (`prefix_hit`).
        """
        scheduler = self.scheduler
        scheduler.requests[child.request_id] = child
        if first:
            scheduler.waiting.prepend_request(child)
        else:
            scheduler.waiting.add_request(child)
        return ForkPoint(
            parent.request_id,
            parent.num_computed_tokens - parent.num_output_placeholders)

    def waiting_queues(self) -> tuple[RequestQueue, RequestQueue]:
        """The queues upstream admits from, in its order: the waiting
        requests that hold KV blocks (parked and resumed parents), then
        the others."""
        return self.release.kv_holding_queue(
            self.scheduler), self.scheduler.waiting

    def next_admission(self) -> Optional[Request]:
        """The request upstream would admit next while nothing runs (it
        waits only for blocks then); None if something runs or nothing
        waits."""
        if self.scheduler.running:
            return None
        admissible = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        return next((request for queue in self.waiting_queues()
                     for request in queue if request.status in admissible),
                    None)

    def evict_until_fits(self, request: Request, fork: Optional[ForkPoint],
                         victims: list[str],
                         evicted: Collection[str]) -> list[str]:
        """Frees parked parents' blocks, in order, until ``request`` fits.

        Args:
            request: The request to admit (`next_admission`).
            fork: Where it forked, if it is a child not admitted yet.
            victims: Parked parents holding blocks, in the order to evict
                them (`sequence_hooks.ordering.eviction_order`).
            evicted: The parked parents whose blocks are freed already.

        Returns:
            The ids of those evicted now.
        """
        pool = self.scheduler.kv_cache_manager.block_pool
        freed, gone = set(evicted), []
        for member_id in victims:
            if pool.get_num_free_blocks() >= self._blocks_to_admit(
                    request, fork, freed):
                break
            self.evict(self.scheduler.requests[member_id])
            freed.add(member_id)
            gone.append(member_id)
        return gone

    def evict(self, request: Request) -> None:
        """Frees a parked parent's KV blocks; its tokens stay, and its
        resume recomputes them (less what the prefix cache gives back).

        Args:
            request: The parked parent.
        """
        self.scheduler.kv_cache_manager.free(request)

    def prefix_hit(self, request: Request, fork: ForkPoint,
                   evicted: Container[str], *args) -> tuple:
        """A new child's prefix-cache hit: its parent's computed context.

        Args:
            request: The child's request, which upstream looks up.
            fork: Where it forked (`queue_fork`).
            evicted: The parked parents whose blocks are freed.
            *args: What else upstream passes: vLLM 0.33 adds
                `max_cache_hit_length` (a cap an auxiliary output connector
                sets, None without one), which a child's hit keeps to too.

        Returns:
            Upstream's tuple: the hit blocks, the tokens they hold, the
            shared-prefix boundary and whether the hit diverged.
        """
        manager = self.scheduler.kv_cache_manager
        parent = self._forked_from(fork, evicted)
        if parent is None:
            # The parent lost its blocks (preempted): compute everything.
            return manager.empty_kv_cache_blocks, 0, 0, False
        shared = min(fork.num_shared, parent.num_computed_tokens)
        if args and args[0] is not None:
            shared = min(shared, args[0])
        blocks = manager.get_blocks(parent.request_id).blocks
        num_blocks = cdiv(shared, self.scheduler.block_size)
        hit = manager.create_kv_cache_blocks(
            tuple(list(group[:num_blocks]) for group in blocks))
        return hit, shared, 0, False

    def _blocks_to_admit(self, request: Request, fork: Optional[ForkPoint],
                         evicted: Container[str]) -> int:
        """New blocks a waiting request needs for its next token: less
        those it holds (a resumed parent), or the full blocks it shares
        with a parent still holding them (a new child)."""
        block_size = self.scheduler.block_size
        needed = cdiv(request.num_tokens + 1, block_size)
        if self._has_blocks(request, evicted):
            return needed - cdiv(request.num_computed_tokens, block_size)
        parent = None if fork is None else self._forked_from(fork, evicted)
        if parent is not None:
            needed -= min(fork.num_shared,
                          parent.num_computed_tokens) // block_size
        return needed

    def _forked_from(self, fork: ForkPoint,
                     evicted: Container[str]) -> Optional[Request]:
        """A pending child's parent, if it still holds its blocks."""
        parent = self.scheduler.requests.get(fork.parent_id)
        if parent is None or not self._has_blocks(parent, evicted):
            return None
        return parent

    def _has_blocks(self, request: Request, evicted: Container[str]) -> bool:
        """Holds KV blocks: an evicted parked parent keeps its computed
        count (its resume cuts its tokens there) but holds none."""
        return (self.release.holds_kv_blocks(request)
                and request.request_id not in evicted)
