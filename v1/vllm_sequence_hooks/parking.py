# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV cache mechanics of the V1 hooks: a child's fork, a parent's park and
its eviction under pressure.

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
- With nothing running, parked parents that hold the blocks the next
  request needs are evicted (blocks freed, the resume recomputes less what
  the prefix cache gives back), so a full cache never deadlocks.
"""

from typing import Any, Optional

from vllm_sequence_hooks.releases import for_installed

from sequence_hooks.lifecycle import Coordinator
from sequence_hooks.ordering import eviction_order
from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.request import Request, RequestStatus


class KvParking:
    """The hooks' KV mechanics on one V1 scheduler, which holds it.

    Args:
        scheduler: The `SequenceHookScheduler`.
        coordinator: Its hooks' coordinator (which members are parked).
    """

    def __init__(self, scheduler: Any, coordinator: Coordinator) -> None:
        self.scheduler = scheduler
        self.coordinator = coordinator
        # What differs on the installed vLLM release.
        self.release = for_installed()
        # Children not yet admitted: their parent and the parent's tokens
        # computed at the fork, which are their prefix hit.
        self.pending_forks: dict[str, tuple[str, int]] = {}
        # Parked parents whose KV blocks were freed under pressure: they
        # recompute their context when they resume.
        self.evicted: set[str] = set()

    def num_parked(self) -> int:
        """Parked parents: upstream counts them as streaming sessions
        against `max_num_seqs`, which the scheduler undoes for its step.

        A parked parent holds no row of the model runner's batch (it drops
        unscheduled requests from it), and counting it could leave its own
        children waiting forever once parents fill the limit.
        """
        return len(self._parked_requests())

    def _parked_requests(self) -> dict[str, float]:
        """The parked members this scheduler holds parked (`park`), with
        when each was parked. A format may park a member whose call has
        ended (a root while its fresh children run): it has no request
        here, and upstream never counted it."""
        requests = self.scheduler.requests
        return {
            member_id: since
            for member_id, since in self.coordinator.parked_members().items()
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

    def queue_fork(self, child: Request, parent: Request, first: bool) -> None:
        """Queues a new child; its prefix hit is ``parent``'s computed
        context: with async scheduling, less the positions of the steps in
        flight, whose KV the child computes itself.

        Args:
            child: The child's request.
            parent: Its parent's.
            first: Whether it goes ahead of new requests (it continues
                work already admitted), else where a new request goes.
        """
        scheduler = self.scheduler
        self.pending_forks[child.request_id] = (parent.request_id,
                                                parent.num_computed_tokens -
                                                parent.num_output_placeholders)
        scheduler.requests[child.request_id] = child
        if first:
            scheduler.waiting.prepend_request(child)
        else:
            scheduler.waiting.add_request(child)

    def requeue_evicted(self, request: Request) -> None:
        """A resumed parent that was evicted has no KV left: its resume is
        a new prefill of the whole context, with a prefix-cache lookup,
        queued as one."""
        self.evicted.discard(request.request_id)
        request.num_computed_tokens = 0
        self.release.kv_holding_queue(self.scheduler).remove_request(request)
        self.scheduler.waiting.prepend_request(request)

    def waiting_queues(self) -> tuple[RequestQueue, RequestQueue]:
        """The queues upstream admits from, in its order: the waiting
        requests that hold KV blocks (parked and resumed parents), then
        the others."""
        return self.release.kv_holding_queue(
            self.scheduler), self.scheduler.waiting

    def forget(self, request_id: str) -> None:
        """Drops a finished or aborted member's KV bookkeeping."""
        self.pending_forks.pop(request_id, None)
        self.evicted.discard(request_id)

    def evict_if_stalled(self) -> None:
        """Frees parked parents' blocks while they alone block the queue.

        With nothing running, the next request to admit waits only for
        blocks; if parked parents hold them, nothing frees them (their
        children are the ones waiting), so parked parents are evicted
        until it fits, in the order both engines share
        (`sequence_hooks.ordering.eviction_order`: the newest first, the
        request's own ancestors last, their blocks being its prefix hit).
        """
        scheduler = self.scheduler
        if scheduler.running:
            return
        admissible = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        candidate = next(
            (request for queue in self.waiting_queues()
             for request in queue if request.status in admissible), None)
        if candidate is None:
            return
        pool = scheduler.kv_cache_manager.block_pool
        for request_id in eviction_order(
                self._parked_requests(), self.evicted,
                self.coordinator.ancestors(candidate.request_id)):
            if pool.get_num_free_blocks() >= self._blocks_to_admit(candidate):
                return
            self.evict(scheduler.requests[request_id])

    def evict(self, request: Request) -> None:
        """Frees a parked parent's KV blocks; its tokens stay, and its
        resume recomputes them (less what the prefix cache gives back)."""
        self.scheduler.kv_cache_manager.free(request)
        self.evicted.add(request.request_id)

    def prefix_hit(self, request: Request, *args) -> Optional[tuple]:
        """A new child's prefix-cache hit: its parent's computed context.

        Args:
            request: The request upstream looks up.
            *args: What else upstream passes: vLLM 0.33 adds
                `max_cache_hit_length` (a cap an auxiliary output connector
                sets, None without one), which a child's hit keeps to too.

        Returns:
            Upstream's tuple (the hit blocks, the tokens they hold, the
            shared-prefix boundary and whether the hit diverged); None if
            ``request`` is no new child (upstream's lookup answers).
        """
        if request.request_id not in self.pending_forks:
            return None
        manager = self.scheduler.kv_cache_manager
        fork = self._forked_from(request.request_id)
        del self.pending_forks[request.request_id]
        if fork is None:
            # The parent lost its blocks (preempted): compute everything.
            return manager.empty_kv_cache_blocks, 0, 0, False
        parent, num_shared = fork
        shared = min(num_shared, parent.num_computed_tokens)
        if args and args[0] is not None:
            shared = min(shared, args[0])
        blocks = manager.get_blocks(parent.request_id).blocks
        num_blocks = cdiv(shared, self.scheduler.block_size)
        hit = manager.create_kv_cache_blocks(
            tuple(list(group[:num_blocks]) for group in blocks))
        return hit, shared, 0, False

    def _blocks_to_admit(self, request: Request) -> int:
        """New blocks a waiting request needs for its next token: less
        those it holds (a resumed parent), or the full blocks it shares
        with a parent still holding them (a new child)."""
        block_size = self.scheduler.block_size
        needed = cdiv(request.num_tokens + 1, block_size)
        if self._has_blocks(request):
            return needed - cdiv(request.num_computed_tokens, block_size)
        parent = self._forked_from(request.request_id)
        if parent is not None:
            parent, num_shared = parent
            needed -= min(num_shared, parent.num_computed_tokens) // block_size
        return needed

    def _forked_from(self, request_id: str) -> Optional[tuple[Request, int]]:
        """A pending child's parent, if it still holds its blocks, and the
        tokens the child shares with it."""
        fork = self.pending_forks.get(request_id)
        if fork is None:
            return None
        parent = self.scheduler.requests.get(fork[0])
        if parent is None or not self._has_blocks(parent):
            return None
        return parent, fork[1]

    def _has_blocks(self, request: Request) -> bool:
        """Holds KV blocks: an evicted parked parent keeps its computed
        count (its resume cuts its tokens there) but holds none."""
        return (self.release.holds_kv_blocks(request)
                and request.request_id not in self.evicted)
