# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the plugin does differently on each supported vLLM release, in one
place.

The plugin's code is the same on every release in
`seams.SUPPORTED_VLLM_VERSIONS` but for the members of `Release`: each has
one implementation per release where upstream differs (`Release` for
0.31.0 and 0.32.0, `Release033` for 0.33.0), picked once by the installed
version (`for_installed`). Each difference is a row of `seams.SEAMS` (why,
and when it can go). An upstream method copied for a release that lacks it
would be in `VENDORED`, its code diffed against the hashed upstream method
and checked by v1/tests/test_v1_seams.py; no supported release needs one
(0.30.0's copy of `Scheduler._holds_kv_blocks` left with 0.30.0).
"""

import dataclasses

from vllm_sequence_hooks.seams import check_vllm_version
from vllm_sequence_hooks.seams_types import Vendored

from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, StreamingUpdate


class Release:
    """vLLM 0.31.0 and 0.32.0: upstream's own members."""

    def kv_holding_queue(self, scheduler: Scheduler) -> RequestQueue:
        """The queue where upstream keeps a waiting request that holds KV
        blocks (a parked or resumed parent), drained before `waiting`.

        Args:
            scheduler: The plugin's scheduler.

        Returns:
            Upstream's `kv_holding_waiting`.
        """
        return scheduler.kv_holding_waiting

    def holds_kv_blocks(self, request: Request) -> bool:
        """Whether a waiting request holds KV blocks (upstream's test).

        Args:
            request: A waiting request.

        Returns:
            What upstream's `Scheduler._holds_kv_blocks` says.
        """
        return Scheduler._holds_kv_blocks(request)

    def update_request_as_session(self, scheduler: Scheduler, session: Request,
                                  update: StreamingUpdate) -> None:
        """Gives a parked session its next chunk, budget included.

        Upstream drops the session's tokens from its computed count on
        (0.31.0, 0.32.0): ``update`` starts with them (the uncomputed
        `<sync>`), so the session's tokens are its own and then the update's.

        Args:
            scheduler: The plugin's scheduler.
            session: The parked parent.
            update: Its next chunk: the tokens from its computed count on,
                then the merged tokens.
        """
        scheduler._update_request_as_session(session, update)


class Release033(Release):
    """vLLM 0.33.0, whose `_update_request_as_session` keeps every output
    token but the last sampled one (0.32.0 kept only the computed ones)."""

    def update_request_as_session(self, scheduler: Scheduler, session: Request,
                                  update: StreamingUpdate) -> None:
        # 0.33 keeps the tokens from the computed count up to the last one;
        # the update brings them again (`Release`), so they go from it. A
        # parked parent's last token is its uncomputed `<sync>`, so this
        # drops nothing unless a token before it was never computed.
        kept = session.num_tokens - 1 - session.num_computed_tokens
        if kept > 0:
            update = dataclasses.replace(
                update, prompt_token_ids=update.prompt_token_ids[kept:])
        super().update_request_as_session(scheduler, session, update)


RELEASES: dict[str, Release] = {
    "0.31.0": Release(),
    "0.32.0": Release(),
    "0.33.0": Release033(),
}


def for_installed() -> Release:
    """The installed vLLM's implementation (refuses an unsupported one).

    Returns:
        The `Release` of the installed vLLM.
    """
    return RELEASES[check_vllm_version()]


# Upstream methods copied for a release that lacks them: none.
VENDORED: tuple[Vendored, ...] = ()
