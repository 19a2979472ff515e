# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stock vLLM as the formats' controllers call it: token ids in, token ids
out, several calls at once.

`LLMBackend` decodes offline through ``LLM.generate`` with
``TokensPrompt``s; `HTTPBackend` sends one OpenAI completions request per
call, its prompt a list of token ids with ``return_token_ids: true``
(vLLM 0.32: the matched stop id is the last of ``choices[0].token_ids``).
"""

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from sequence_hooks_testkit.formats.threadweaver_controller import Completion


class LLMBackend:
    """Stock vLLM offline: one ``LLM.generate`` per batch of calls.

    Args:
        llm: A ``vllm.LLM``.
    """

    def __init__(self, llm):
        self.llm = llm
        self.max_model_len = llm.llm_engine.model_config.max_model_len

    def generate(self, prompts: list[list[int]],
                 params: list[dict[str, Any]]) -> list[Completion]:
        """Decodes every prompt with its parameters in one batch."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            [SamplingParams(**p) for p in params],
            use_tqdm=False)
        return [
            Completion(list(o.outputs[0].token_ids),
                       o.outputs[0].finish_reason) for o in outputs
        ]


class HTTPBackend:
    """Stock ``vllm serve`` over its OpenAI completions API.

    Args:
        base_url: The server, e.g. ``http://127.0.0.1:8000``.
        model: The served model's name; the first listed if None.
        timeout: Seconds a request may take.
    """

    def __init__(self,
                 base_url: str,
                 model: Optional[str] = None,
                 timeout: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        listed = self._send("GET", "/v1/models")["data"]
        card = next(m for m in listed if model in (None, m["id"]))
        self.model = card["id"]
        self.max_model_len = card["max_model_len"]
        # Completions requests sent.
        self.requests = 0

    def _send(self, method: str, path: str, body: Optional[dict] = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout) as answer:
            return json.loads(answer.read())

    def _complete(self, prompt: list[int], params: dict[str,
                                                        Any]) -> Completion:
        body = {
            "model": self.model,
            "prompt": prompt,
            "return_token_ids": True,
            **params
        }
        choice = self._send("POST", "/v1/completions", body)["choices"][0]
        return Completion(list(choice["token_ids"]), choice["finish_reason"])

    def generate(self, prompts: list[list[int]],
                 params: list[dict[str, Any]]) -> list[Completion]:
        """Sends one request per prompt, all at once (as the reference's
        ``asyncio.gather`` does)."""
        self.requests += len(prompts)
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            return list(pool.map(self._complete, prompts, params))
