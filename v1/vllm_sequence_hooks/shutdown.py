# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Ends every open stream when `vllm serve` (V1) shuts down.

Loaded with `vllm serve ... --middleware
vllm_sequence_hooks.shutdown.FinishStreamsOnShutdown`, vLLM's own option
for ASGI middleware; nothing of vLLM is patched. It fixes an upstream
hang, hooked or not, which long hooked streams (parents parked, children
live) make likely.

Why: on SIGTERM, vLLM 0.32's `serve_http` stops the engine client before
it stops uvicorn. `AsyncLLM.shutdown` stops the engine core (with the
default `--shutdown-timeout 0`, at once, so the core's own abort outputs
never arrive), closes the output socket, whose reader then queues an
`EngineDeadError`, and cancels the output handler from another thread.
If the handler reads that error first, it hands it to every request and
each stream ends with an error event; if the cancel lands first, no
request hears anything: each waits in `AsyncLLM.generate` for an output
that never comes, and uvicorn's graceful shutdown (no timeout) waits for
their connections for ever. The server never exits; SIGKILL tears every
stream.

How: once the engine client is dead (`errored`) or the HTTP server is
told to exit (`should_exit`), every request the frontend still holds is
aborted in its output processor, which gives each request's stream its
final output (finish reason `abort`) as a client's abort does: each
handler sends its last event and `[DONE]`, the connections close and
uvicorn's shutdown completes. Requests that drained in time
(`--shutdown-timeout N`) are untouched: the engine client is dead only
after the drain.
"""

import asyncio
import logging
from typing import Any, Optional

# Under vLLM's logger, whose handler prints the line.
logger = logging.getLogger("vllm.sequence_hooks.shutdown")

# How often the watcher looks at the server's state, in seconds: the
# shutdown is at most this much later.
POLL_S = 0.1


def finish_open_requests(engine_client: Any) -> int:
    """Aborts every request the frontend still holds: their streams get
    their final output (finish reason `abort`).

    Args:
        engine_client: The server's `AsyncLLM`.

    Returns:
        How many requests were ended.
    """
    processor = getattr(engine_client, "output_processor", None)
    request_ids = list(getattr(processor, "request_states", None) or ())
    if request_ids:
        processor.abort_requests(request_ids, internal=True)
    return len(request_ids)


async def watch(app: Any) -> None:
    """Ends the open requests once the server stops (runs for the app's
    life)."""
    announced = False
    while True:
        await asyncio.sleep(POLL_S)
        server = getattr(app.state, "server", None)
        engine_client = getattr(app.state, "engine_client", None)
        if engine_client is None:
            continue
        stopping = server is not None and server.should_exit
        if not (stopping or engine_client.errored):
            continue
        ended = finish_open_requests(engine_client)
        if ended or not announced:
            logger.info(
                "sequence hooks: the server stops; %d open request(s) "
                "ended with finish reason abort", ended)
            announced = True


class FinishStreamsOnShutdown:
    """ASGI middleware that runs `watch` beside the app.

    Args:
        app: The ASGI app it wraps.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.watcher: Optional[asyncio.Task] = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self.watcher is None and "app" in scope:
            self.watcher = asyncio.get_running_loop().create_task(
                watch(scope["app"]), name="FinishStreamsOnShutdown")
        await self.app(scope, receive, send)
