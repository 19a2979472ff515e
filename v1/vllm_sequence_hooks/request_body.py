# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the plugin's ASGI middleware share: reading a completion or chat
request's JSON body before vLLM's app does, and handing the app the same
body.

`beam_search.RefuseBeamSearch` and `data_parallel.SamplesOnOneEngine`
decide from a field of the body (`use_beam_search`, `n`). ASGI hands a
body out once, in chunks, so they read it whole (`read_body`), decide,
and give the app a `receive` that replays it (`replaying`).
"""

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Optional

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

# The OpenAI routes whose requests take sampling fields (`n`,
# `use_beam_search`).
ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})


def is_generation_request(scope: Scope) -> bool:
    """Whether an ASGI request is a completion or chat POST.

    Args:
        scope: The request's ASGI scope.

    Returns:
        True for a POST to one of `ROUTES`.
    """
    return (scope["type"] == "http" and scope.get("method") == "POST"
            and scope.get("path") in ROUTES)


async def read_body(receive: Receive) -> Optional[bytes]:
    """The request's whole body.

    Args:
        receive: The ASGI receive channel, before the app read anything.

    Returns:
        The body, or None if the client left before sending it all.
    """
    chunks, message = [], {"more_body": True}
    while message.get("more_body", False):
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
    return b"".join(chunks)


def replaying(body: bytes, receive: Receive) -> Receive:
    """A receive channel that gives ``body`` first, then what ``receive``
    gives (the client's disconnect).

    Args:
        body: The body `read_body` read.
        receive: The request's own receive channel.

    Returns:
        The channel to hand the app.
    """
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def body_field(body: bytes, name: str) -> Any:
    """A top-level field of a JSON body.

    Args:
        body: The request's body.
        name: The field.

    Returns:
        Its value; None if the body is not a JSON object (the frontend
        answers those itself) or has no such field.
    """
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return data.get(name) if isinstance(data, dict) else None
