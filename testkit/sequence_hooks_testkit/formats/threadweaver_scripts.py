# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A scripted model that writes ThreadWeaver's format, in text: the
model-free tests of the format's evaluation controller
(`sequence_hooks_references.formats.threadweaver_simple_eval`) script it,
behind stock vLLM's completions API as that controller sees it
(`sequence_hooks_references.formats.backends.ScriptedServer`)."""

import re
from dataclasses import dataclass, field
from typing import Any

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
