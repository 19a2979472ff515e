# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the plugin does differently on each supported vLLM release, in one
place.

The plugin's code is the same on every release in
`seams.SUPPORTED_VLLM_VERSIONS` but for the members of `Release`: each has
one implementation per release where upstream differs (`Release` for
0.31.0 and later, `Release030` for 0.30.0), picked once by the installed
version (`for_installed`). Each difference is a row of `seams.SEAMS` (why,
and when it can go), and each upstream method copied for a release that
lacks it is in `VENDORED`, its code diffed against the hashed upstream
method and checked by v1/tests/test_v1_seams.py.
"""

from vllm_sequence_hooks.seams import Vendored, check_vllm_version

from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus, StreamingUpdate


class Release:
    """vLLM 0.31.0 and 0.32.0: upstream's own members."""

    def kv_holding_queue(self, scheduler: Scheduler) -> RequestQueue:
        """The queue where upstream keeps a waiting request that holds KV
        blocks (a parked or resumed parent), drained before `waiting`."""
        return scheduler.kv_holding_waiting

    def holds_kv_blocks(self, request: Request) -> bool:
        """Whether a waiting request holds KV blocks (upstream's test)."""
        return Scheduler._holds_kv_blocks(request)

    def update_request_as_session(self, scheduler: Scheduler, session: Request,
                                  update: StreamingUpdate) -> None:
        """Gives a parked session its next chunk, budget included."""
        scheduler._update_request_as_session(session, update)


class Release030(Release):
    """vLLM 0.30.0, which predates the split of its waiting queues
    (`kv_holding_waiting` and `_holds_kv_blocks` came with 0.31.0) and
    sets no budget in `_update_request_as_session`."""

    def kv_holding_queue(self, scheduler: Scheduler) -> RequestQueue:
        # 0.30 keeps every waiting request that is blocked (a parked
        # parent) or holds KV blocks (a resumed one) in one queue, drained
        # before `waiting` as 0.31's `kv_holding_waiting` is.
        return scheduler.skipped_waiting

    def holds_kv_blocks(self, request: Request) -> bool:
        return self._holds_kv_blocks(request)

    # vLLM 0.31.0's `Scheduler._holds_kv_blocks` (`VENDORED`).
    @staticmethod
    def _holds_kv_blocks(request: Request) -> bool:
        # Whether a request currently has kv blocks allocated.
        # While always the case when status is WAITING_FOR_REMOTE_KVS
        # or WAITING_FOR_STREAMING_REQ, there are such cases where it's
        # WAITING or PREEMPTED.
        return (
            request.num_computed_tokens > 0
            # num_computed_tokens is reset to 0 if kv transfer fails for
            # requests in WAITING_FOR_REMOTE_KVS state, before their
            # allocated blocks are freed.
            or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS)

    def update_request_as_session(self, scheduler: Scheduler, session: Request,
                                  update: StreamingUpdate) -> None:
        super().update_request_as_session(scheduler, session, update)
        # 0.30 keeps the first chunk's budget: a resumed parent would
        # write a whole new one after its merge. 0.31 sets it there.
        session.max_tokens = update.max_tokens


RELEASES: dict[str, Release] = {
    "0.30.0": Release030(),
    "0.31.0": Release(),
    "0.32.0": Release(),
}


def for_installed() -> Release:
    """The installed vLLM's implementation (refuses an unsupported one)."""
    return RELEASES[check_vllm_version()]


# Upstream methods copied for a release that lacks them.
VENDORED: tuple[Vendored, ...] = (Vendored(
    "vllm_sequence_hooks.releases:Release030._holds_kv_blocks",
    "vllm.v1.core.sched.scheduler:Scheduler._holds_kv_blocks", "0.31.0",
    "4fb86dcf349be3cf97fd7c08de90b3b2870e584156e1a7320dbf758c5ee28aa6",
    "1427c9a9f454a17fdecf1f2b40c219542d5a3eac0d6a5943f9fc69b68cb5c758"), )
