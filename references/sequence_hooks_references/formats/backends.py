# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stock vLLM as the formats' controllers call it, several calls at once:
token ids in and out (`generate`, ThreadWeaver's) or text (`generate_text`,
APR's).

`LLMBackend` decodes offline through ``LLM.generate`` (token ids as
``TokensPrompt``s); `HTTPBackend` sends one OpenAI completions request per
call, a token-id prompt with ``return_token_ids: true`` (vLLM 0.32: the
matched stop id is the last of ``choices[0].token_ids``);
`ScriptedBackend`, `ScriptedTextBackend` and `ScriptedServer` (token-id
prompts, text out, special tokens kept) decode a scripted model,
model-free; `Recorded` keeps a backend's calls.
"""

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from sequence_hooks_references.formats.apr_controller import TextCompletion
from sequence_hooks_references.formats.threadweaver_controller import (
    Completion)


def _sampled_logprobs(completion) -> Optional[list[float]]:
    """Each sampled token's logprob in a `CompletionOutput`, if asked."""
    if completion.logprobs is None:
        return None
    return [
        entry[token].logprob
        for token, entry in zip(completion.token_ids, completion.logprobs)
    ]


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
                       o.outputs[0].finish_reason,
                       _sampled_logprobs(o.outputs[0])) for o in outputs
        ]

    def samples(self, prompt: list[int], params: dict) -> list[list[int]]:
        """The ids each sample of one request sampled (``params["n"]`` of
        them), in order: stock vLLM's own parallel sampling."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        [output] = self.llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                                     [SamplingParams(**params)],
                                     use_tqdm=False)
        return [list(sample.token_ids) for sample in output.outputs]

    def generate_text(self, prompts: list[str],
                      params: list[dict[str, Any]]) -> list[TextCompletion]:
        """Decodes every text prompt with its parameters in one batch."""
        from vllm import SamplingParams
        outputs = self.llm.generate(prompts,
                                    [SamplingParams(**p) for p in params],
                                    use_tqdm=False)
        return [
            TextCompletion(o.outputs[0].text, o.outputs[0].finish_reason,
                           o.outputs[0].stop_reason,
                           list(o.outputs[0].token_ids),
                           _sampled_logprobs(o.outputs[0])) for o in outputs
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

    def _choices(self, prompts: list, params: list[dict[str, Any]]):
        self.requests += len(prompts)

        def one(prompt, extra):
            body = {"model": self.model, "prompt": prompt, **extra}
            return self._send("POST", "/v1/completions", body)["choices"][0]

        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            return list(pool.map(one, prompts, params))

    def generate(self, prompts: list[list[int]],
                 params: list[dict[str, Any]]) -> list[Completion]:
        """Sends one request per token-id prompt, all at once (as the
        reference's ``asyncio.gather`` does)."""
        choices = self._choices(
            prompts, [dict(p, return_token_ids=True) for p in params])
        return [
            Completion(list(c["token_ids"]), c["finish_reason"],
                       (c.get("logprobs") or {}).get("token_logprobs"))
            for c in choices
        ]

    def samples(self, prompt: list[int], params: dict) -> list[list[int]]:
        """The ids each sample of one request sampled (``params["n"]`` of
        them), in order: stock vLLM's own parallel sampling."""
        self.requests += 1
        body = dict(params,
                    model=self.model,
                    prompt=prompt,
                    return_token_ids=True)
        choices = self._send("POST", "/v1/completions", body)["choices"]
        return [
            list(c["token_ids"])
            for c in sorted(choices, key=lambda c: c["index"])
        ]

    def generate_text(self, prompts: list[str],
                      params: list[dict[str, Any]]) -> list[TextCompletion]:
        """Sends one request per text prompt, all at once."""
        choices = self._choices(
            prompts, [dict(p, return_token_ids=True) for p in params])
        return [
            TextCompletion(c["text"], c["finish_reason"], c.get("stop_reason"),
                           list(c["token_ids"]), (c.get("logprobs")
                                                  or {}).get("token_logprobs"))
            for c in choices
        ]


class ScriptedBackend:
    """Stock vLLM over a scripted greedy model, as a controller sees it:
    each call decodes to a stop id (kept), EOS or its ``max_tokens``.

    Args:
        next_token: The model: a context's next token id.
        eos: The EOS id.
        max_model_len: The context window.
    """

    def __init__(self, next_token: Callable[[list[int]], int], eos: int,
                 max_model_len: int):
        self.next_token = next_token
        self.eos = eos
        self.max_model_len = max_model_len

    def generate(self, prompts: list[list[int]],
                 params: list[dict[str, Any]]) -> list[Completion]:
        """Decodes every prompt in turn."""
        done = []
        for prompt, one in zip(prompts, params):
            context, tokens, reason = list(prompt), [], "length"
            while len(tokens) < one["max_tokens"]:
                token = self.next_token(context)
                context.append(token)
                tokens.append(token)
                if token == self.eos or token in one["stop_token_ids"]:
                    reason = "stop"
                    break
            done.append(Completion(tokens, reason))
        return done


class ScriptedTextBackend:
    """Stock vLLM's completions API over a scripted greedy model, as a
    text controller sees it: each prompt tokenized as the server does,
    decoded to EOS, its ``max_tokens`` or one of its ``stop`` strings; the
    text (special tokens skipped) ends before a matched stop string, the
    ids keep every sampled token.

    Args:
        next_token: The model: a context's next token id.
        tokenizer: ``encode(text)`` (special tokens in the text read as
            such), ``decode(ids, skip_special_tokens=...)`` and
            ``eos_token_id``.
    """

    def __init__(self, next_token: Callable[[list[int]], int], tokenizer):
        self.next_token = next_token
        self.tokenizer = tokenizer

    def generate_text(self, prompts: list[str],
                      params: list[dict[str, Any]]) -> list[TextCompletion]:
        """Decodes every prompt in turn."""
        done = []
        for prompt, one in zip(prompts, params):
            context = self.tokenizer.encode(prompt)
            tokens: list[int] = []
            reason, matched = "length", None
            while len(tokens) < one["max_tokens"]:
                token = self.next_token(context)
                context.append(token)
                tokens.append(token)
                if token == self.tokenizer.eos_token_id:
                    reason = "stop"
                    break
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                matched = next((s for s in one.get("stop", []) if s in text),
                               None)
                if matched is not None:
                    reason = "stop"
                    break
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            if matched is not None:
                text = text[:text.index(matched)]
            done.append(TextCompletion(text, reason, matched, tokens))
        return done


class ScriptedServer:
    """Stock vLLM's completions API over a scripted model: a token-id
    prompt decoded greedily to EOS, its ``max_tokens`` or one of its
    ``stop`` strings; the text (special tokens kept) holds neither the
    EOS nor a matched stop string, the ids every sampled token.

    Args:
        model: The model: ``next_token(context)``, its greedy choice, and
            a ``tokenizer`` that decodes (as
            `sequence_hooks_testkit.formats.threadweaver_scripts.ScriptedModel`).
    """

    def __init__(self, model):
        self.model = model

    def generate_text(self, prompts: list[list[int]],
                      params: list[dict[str, Any]]) -> list[TextCompletion]:
        """Decodes every prompt in turn."""
        tokenizer = self.model.tokenizer
        eos = tokenizer.eos_token_id
        done = []
        for prompt, one in zip(prompts, params):
            context, tokens = list(prompt), []
            reason, matched = "length", None
            while len(tokens) < one["max_tokens"]:
                token = self.model.next_token(context)
                context.append(token)
                tokens.append(token)
                text = tokenizer.decode(tokens)
                hit = [s for s in one["stop"] if s in text]
                if token == eos or hit:
                    reason, matched = "stop", (hit or [None])[0]
                    break
            text = tokenizer.decode([t for t in tokens if t != eos])
            if matched is not None:
                text = text[:text.index(matched)]
            done.append(TextCompletion(text, reason, matched, tokens))
        return done


class Recorded:
    """A backend whose calls are kept, in the order sent: each prompt,
    its parameters and its completion."""

    def __init__(self, backend):
        self.backend = backend
        self.max_model_len = getattr(backend, "max_model_len", None)
        self.calls: list[tuple[Any, dict[str, Any], Any]] = []

    def generate(self, prompts: list, params: list[dict]) -> list:
        """The backend's `generate`, kept."""
        done = self.backend.generate(prompts, params)
        self.calls += zip(prompts, params, done)
        return done

    def generate_text(self, prompts: list, params: list[dict]) -> list:
        """The backend's `generate_text`, kept."""
        done = self.backend.generate_text(prompts, params)
        self.calls += zip(prompts, params, done)
        return done
