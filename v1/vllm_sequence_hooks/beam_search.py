# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Refuses beam search on a hooked `vllm serve` (V1) with V0's 400.

Loaded with `vllm serve ... --middleware
vllm_sequence_hooks.beam_search.RefuseBeamSearch`, vLLM's own option for
ASGI middleware (`--special-kwargs` adds it); nothing of vLLM is patched.
The module keeps its name, what beam search meets here, because
five-flag command lines name it.

Why here: vLLM's frontend runs beam search (`use_beam_search` on
`/v1/completions` and `/v1/chat/completions`) as one one-token request per
beam and step, with sampling parameters any request could have, so the
request check (`admission`) cannot tell them apart: a `<promise>` there
spawns a child that its one-token request aborts at once, nothing ever
merges, and the server would answer 200 with no hooks at all. The HTTP
request is the last place that still says "beam search", so the refusal
reads it there, before the frontend parses it.

Offline `LLM.beam_search` has no such place (the plugin runs in the
engine core only): there it runs hook-free, as described in docs/v1.md.
"""

import json

from vllm_sequence_hooks.request_body import (App, Receive, Scope, Send,
                                              body_field,
                                              is_generation_request, read_body,
                                              replaying)

BEAM_SEARCH = (
    "use_beam_search cannot be used with sequence hooks (this server runs "
    "with special_kwargs): beam search runs every step as its own one-token "
    "request, so a <promise> can never spawn a child nor a <sync> merge "
    "one. Use sampling instead (n, seed).")


def asks_for_beam_search(body: bytes) -> bool:
    """Whether a request body turns beam search on (anything the frontend
    would not parse is left to it).

    Args:
        body: The HTTP request's body.

    Returns:
        True if its `use_beam_search` is set.
    """
    return bool(body_field(body, "use_beam_search"))


class RefuseBeamSearch:
    """ASGI middleware: a 400 in vLLM's error shape, naming
    `use_beam_search`, for a completion or chat request that asks for beam
    search; every other request passes through untouched.

    Args:
        app: The application it wraps (vLLM's FastAPI app).
    """

    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive,
                       send: Send) -> None:
        if not is_generation_request(scope):
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:
            # The client left: nothing to answer.
            return
        if asks_for_beam_search(body):
            await self._refuse(send)
            return
        await self.app(scope, replaying(body, receive), send)

    @staticmethod
    async def _refuse(send: Send) -> None:
        payload = json.dumps({
            "error": {
                "message": BEAM_SEARCH,
                "type": "BadRequestError",
                "param": "use_beam_search",
                "code": 400,
            }
        }).encode()
        await send({
            "type":
            "http.response.start",
            "status":
            400,
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(payload)).encode())],
        })
        await send({"type": "http.response.body", "body": payload})
