# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A scripted model that writes ThreadWeaver's format, in text, and stock
vLLM's completions API over it as a text controller sees it
(`threadweaver_simple_eval`): the model-free tests of the format's
evaluation controller script both sides with them."""

import re
from dataclasses import dataclass, field
from typing import Any

from sequence_hooks_testkit.formats.apr_controller import TextCompletion

# A joined thread, and an open thread's header.
THREADS = re.compile(r"\n?<Thread>.*?</Thread>", re.DOTALL)
OPEN_THREAD = re.compile(r"<Thread>\n([^:]*):")


@dataclass
class ScriptedModel:
    """Greedy decoding of fixed texts after ``prompt``: in an open thread
    its label's script after the header; otherwise ``root``, read with
    every joined thread left out. The next token is the first of the
    script's rest as the tokenizer splits it (a script writes the EOS's
    text where it ends); past the script, or off it: EOS.

    Args:
        tokenizer: ``encode(text)``, ``decode(ids)`` (special tokens
            kept) and ``eos_token_id``.
        prompt: The prompt's text.
        root: The root's script.
        threads: Each label's script.
    """

    tokenizer: Any
    prompt: str
    root: str
    threads: dict[str, str] = field(default_factory=dict)

    def next_token(self, context: list[int]) -> int:
        """The model's greedy choice.

        Args:
            context: A call's ids, the prompt's first.

        Returns:
            The token after them.
        """
        text = self.tokenizer.decode(context)[len(self.prompt):]
        opened = text.rfind("<Thread>")
        if opened > text.rfind("</Thread>"):
            header = OPEN_THREAD.match(text, opened)
            script = self.threads[header.group(1)]
            done = text[header.end():]
        else:
            script, done = self.root, THREADS.sub("", text)
        if not script.startswith(done) or script == done:
            return self.tokenizer.eos_token_id
        return self.tokenizer.encode(script[len(done):])[0]


class ScriptedServer:
    """Stock vLLM's completions API over a scripted model: a token-id
    prompt decoded greedily to EOS, its ``max_tokens`` or one of its
    ``stop`` strings; the text (special tokens kept) holds neither the
    EOS nor a matched stop string, the ids every sampled token.

    Args:
        model: The model (its ``tokenizer`` decodes).
    """

    def __init__(self, model: ScriptedModel):
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
