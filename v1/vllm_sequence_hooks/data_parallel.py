# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Keeps the samples of an `n > 1` request on one engine under vLLM's
data parallelism (`vllm serve --data-parallel-size N`).

Loaded by `--special-kwargs` (`config.MIDDLEWARE`) through vLLM's own
option for ASGI middleware, `--middleware`; nothing of vLLM is patched.

Why: V1's frontend fans an `n > 1` request out as one engine request per
sample (`vllm/v1/engine/parallel_sampling.py`), and its data-parallel
client places each of them on its own (`DPLBAsyncMPClient`, by load), so
the samples of one request may run on different engine cores. Each
sample's tree lives in the engine core that ran it, but the frontend
keeps the `kv_transfer_params` of one engine output per response: the
sample that finishes last (`RequestOutput.add` and the `FINAL_ONLY`
aggregation keep one dict; upstream's open PR #38900 proposes one per
sample). The plugin's transport therefore has the last sample to finish
carry the trees of all its request's samples (`transport.SampleTrees`),
which only an engine core that ran all of them can do. Spread over two
engines, the trees of the samples on the other engine were lost without
a word.

How: a completion or chat request with `n > 1` that names no engine gets
vLLM's own routing header, `X-data-parallel-rank` (the one a router
sets), so all its samples go to one engine. Engines are taken in turn,
one request after the other; requests with `n = 1` (and requests that
already name an engine) pass through untouched and keep vLLM's
load-aware placement. With one engine behind this server (no data
parallelism, or the external load balancer's one engine per server) it
does nothing.
"""

import itertools
from typing import Any, Optional

from vllm_sequence_hooks.request_body import (App, Receive, Scope, Send,
                                              body_field,
                                              is_generation_request, read_body,
                                              replaying)

# vLLM's routing header (`OpenAIServing._get_data_parallel_rank`).
RANK_HEADER = b"x-data-parallel-rank"


def num_samples(body: bytes) -> int:
    """The `n` of a request body (1 for anything the frontend would
    refuse or parse otherwise: it answers those itself).

    Args:
        body: The HTTP request's body.

    Returns:
        How many samples the request asks for.
    """
    n = body_field(body, "n")
    return n if isinstance(n, int) and not isinstance(n, bool) else 1


def engines_behind(vllm_config: Any) -> int:
    """How many engine cores the API server's data-parallel client places
    requests on, the range of `X-data-parallel-rank`
    (`InputProcessor.process_inputs`).

    Args:
        vllm_config: The API server's `VllmConfig`.

    Returns:
        The number of engines this server routes to.
    """
    parallel = vllm_config.parallel_config
    return (parallel.data_parallel_size_local
            if parallel.local_engines_only else parallel.data_parallel_size)


class SamplesOnOneEngine:
    """ASGI middleware: a completion or chat request with `n > 1` and no
    `X-data-parallel-rank` header gets one, naming the next engine in
    turn, so its samples and their trees share an engine core; every
    other request passes through untouched.

    Args:
        app: The application it wraps (vLLM's FastAPI app).
    """

    def __init__(self, app: App) -> None:
        self.app = app
        # Read from the app's state at the first request (the server sets
        # it up after building the middleware stack).
        self._engines: Optional[int] = None
        self._turn = itertools.count()

    def _num_engines(self, scope: Scope) -> int:
        if self._engines is None:
            state = getattr(scope.get("app"), "state", None)
            vllm_config = getattr(state, "vllm_config", None)
            self._engines = (1 if vllm_config is None else
                             engines_behind(vllm_config))
        return self._engines

    def next_rank(self) -> int:
        """The engine the next pinned request goes to.

        Returns:
            A data-parallel rank among the engines behind this server.
        """
        return next(self._turn) % (self._engines or 1)

    async def __call__(self, scope: Scope, receive: Receive,
                       send: Send) -> None:
        if (not is_generation_request(scope) or self._num_engines(scope) < 2
                or any(name.lower() == RANK_HEADER
                       for name, _ in scope.get("headers", ()))):
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:
            # The client left: nothing to route.
            return
        if num_samples(body) > 1:
            scope = dict(scope)
            scope["headers"] = list(scope.get("headers", ())) + [
                (RANK_HEADER, str(self.next_rank()).encode())
            ]
        await self.app(scope, replaying(body, receive), send)
