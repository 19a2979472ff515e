# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The client-side join over HTTP: `client_join`'s sender for an
OpenAI-compatible server (a stock `vllm serve`).

Requests go to `/v1/completions` with the prompt as token ids, streamed,
with `logprobs: 0` and `return_tokens_as_token_ids` so that every chunk
names its exact token ids, and the `<sync>` token as a stop token. The
client is aiohttp, as vLLM's own serving benchmark uses: an asyncio client
over httpx's connection pool burned the shared CPU itself at 32 requests
in flight (docs/benchmarks.md).
"""

import asyncio
import json
from typing import Optional

import aiohttp

from sequence_hooks_references.client_join import (JoinRequest, JoinResult,
                                                   JoinTask, OptionsFn,
                                                   sender_defaults)

# Seconds a request may take in all; every wait is bounded.
REQUEST_SECONDS = 600
# Below the server's keep-alive timeout (uvicorn: 5 s).
KEEPALIVE_SECONDS = 2.0
TOKEN_ID_PREFIX = "token_id:"


def client_session() -> aiohttp.ClientSession:
    """An aiohttp session with no cap on open connections and a bounded
    time per request.

    Idle connections are closed before the server's keep-alive timeout
    (uvicorn's 5 s) would close them: reusing one the server is closing
    fails the request ("Server disconnected").
    """
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0,
                                       keepalive_timeout=KEEPALIVE_SECONDS),
        timeout=aiohttp.ClientTimeout(total=REQUEST_SECONDS))


async def stream_completion(session: aiohttp.ClientSession, base: str,
                            body: dict):
    """Streams one completion, yielding each chunk's first choice.

    Args:
        session: The client session.
        base: The server's base URL.
        body: The request body (``stream`` is set here).

    Raises:
        RuntimeError: the server answered with an error.
    """
    async with session.post(f"{base}/v1/completions",
                            json={
                                **body, "stream": True
                            }) as response:
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):].strip()
            if data == b"[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            yield chunk["choices"][0]


class HttpSender:
    """Sends the join's requests to a server, each streamed by its own
    asyncio task.

    Args:
        session: The client session.
        base: The server's base URL.
        model: The served model's name.
        defaults: Request fields of every request (e.g. temperature).
    """

    def __init__(self,
                 session: aiohttp.ClientSession,
                 base: str,
                 model: str,
                 defaults: Optional[dict] = None):
        self.session = session
        self.base = base
        self.model = model
        self.defaults = sender_defaults(defaults)
        self._streams: dict[str, asyncio.Task] = {}

    def submit(self, request: JoinRequest) -> None:
        body = {
            **self.defaults,
            **request.options,
            "model": self.model,
            "prompt": request.prompt_ids,
            "max_tokens": request.max_tokens,
            "stop_token_ids": request.stop_token_ids,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        self._streams[request.request_id] = asyncio.create_task(
            self._stream(request, body))

    def cancel(self, request_id: str) -> None:
        # Closing the connection makes the server abort the request.
        task = self._streams.pop(request_id, None)
        if task is not None:
            task.cancel()

    async def _stream(self, request: JoinRequest, body: dict) -> None:
        try:
            async for choice in stream_completion(self.session, self.base,
                                                  body):
                tokens = (choice.get("logprobs") or {}).get("tokens") or []
                token_ids = [int(t[len(TOKEN_ID_PREFIX):]) for t in tokens]
                reason = choice.get("finish_reason")
                if token_ids or reason is not None:
                    request.on_output(token_ids, reason)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the task's failure, handed to the join
            request.on_error(error)
        finally:
            self._streams.pop(request.request_id, None)


async def server_max_model_len(session: aiohttp.ClientSession, base: str,
                               model: str) -> int:
    """The served model's `max_model_len`, from `/v1/models`."""
    async with session.get(f"{base}/v1/models") as response:
        cards = (await response.json())["data"]
    return next(card["max_model_len"] for card in cards if card["id"] == model)


async def run_join(sender: HttpSender,
                   task_id: str,
                   prompt_ids: list[int],
                   max_tokens: int,
                   hooks,
                   max_model_len: int,
                   tokenizer,
                   options: Optional[OptionsFn] = None) -> JoinResult:
    """Runs one request's join over HTTP.

    Args:
        sender: The sender to the stock server.
        task_id: Unique id of the join.
        prompt_ids: The prompt.
        max_tokens: The request's budget.
        hooks: The hook configuration, resolved to ids.
        max_model_len: The server's longest sequence.
        tokenizer: The model's tokenizer.
        options: Extra request fields per sequence and segment.

    Returns:
        The join's result.

    Raises:
        RuntimeError: a request of the join failed.
    """
    done = asyncio.get_running_loop().create_future()
    task = JoinTask(task_id,
                    prompt_ids,
                    max_tokens,
                    hooks,
                    max_model_len,
                    tokenizer,
                    sender,
                    options,
                    on_done=lambda t: done.done() or done.set_result(t))
    task.start()
    await done
    if task.error is not None:
        raise RuntimeError(f"join {task_id} failed") from task.error
    return task.result
