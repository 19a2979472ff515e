# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Texts of a promise tree: what a merge appends, what a member's text
shows, and how a Hugging Face tokenizer turns one into the other."""

from collections.abc import Sequence
from typing import Any, Protocol

from sequence_hooks.tree import LiveNode


def merged_text(children: Sequence[LiveNode], separator: str) -> str:
    """The text a merge appends: the children's texts in promise order."""
    return separator.join(child.text for child in children)


def without_hook_tokens(text: str, hook_token_strings: Sequence[str]) -> str:
    """``text`` with every hook token's string removed.

    Hook tokens show in a detokenized text when they are not special tokens
    of the tokenizer, or special tokens are not skipped.
    """
    for token in hook_token_strings:
        text = text.replace(token, "")
    return text


def encode_merge(tokenizer: Any, text: str) -> list[int]:
    """Token ids of merge text with a Hugging Face tokenizer: text that
    spells a special token stays text, never a control token."""
    return tokenizer.encode(text,
                            add_special_tokens=False,
                            split_special_tokens=True)


def decode_own(tokenizer: Any, token_ids: list[int]) -> str:
    """A member's own text from its tokens with a Hugging Face tokenizer
    (special tokens skipped), where the engine has none."""
    return tokenizer.decode(token_ids, skip_special_tokens=True)


class Texts(Protocol):
    """A model's text codec, as the lifecycle uses it."""

    def encode(self, text: str) -> list[int]:
        """Token ids of text merged into a member; text that spells a
        special token stays text."""
        ...

    def decode(self, token_ids: list[int]) -> str:
        """A member's own text from its tokens (hook tokens left out)."""
        ...


class TokenizerTexts:
    """`Texts` of a Hugging Face tokenizer (`encode_merge`, `decode_own`).

    Args:
        tokenizer: The tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return encode_merge(self.tokenizer, text)

    def decode(self, token_ids: list[int]) -> str:
        return decode_own(self.tokenizer, token_ids)
