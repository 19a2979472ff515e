# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checks that a prompt is something the model can take, with reasons.

Two holes in vLLM 0.9.2's own checks: a text that is not valid Unicode
(a lone surrogate such as "\\ud800", which JSON can carry) reaches the
tokenizer, whose error names its internal types; and prompt token ids
are compared with the tokenizer's `vocab_size` taken as an id, so the id
equal to the vocabulary size passes, and negative ids are not checked;
and prompt embeddings are unpickled even where they are not enabled.
"""

from collections.abc import Sequence
from typing import Optional, Union


def check_prompt_text(text: str) -> None:
    """Refuses a prompt text that is not valid Unicode.

    Args:
        text: The prompt as the request gave it (after any chat template).

    Raises:
        ValueError: naming the first code point that cannot be encoded.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"The prompt is not valid Unicode text: it contains a lone "
            f"surrogate code point U+{ord(text[e.start]):04X} at character "
            f"{e.start}, which has no UTF-8 encoding (in JSON, a \\uD800-"
            f"\\uDFFF escape must be half of a surrogate pair).") from None


def check_prompt_token_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    """Refuses prompt token ids outside the model's vocabulary.

    Args:
        token_ids: The prompt's token ids.
        vocab_size: The model's vocabulary size: valid ids are
            0 to vocab_size - 1.

    Raises:
        ValueError: naming the first id out of range and the range.
    """
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise ValueError(
                f"Token id {token_id} is out of vocabulary: this model's "
                f"token ids are 0 to {vocab_size - 1}.")


def check_prompt_embeds_allowed(prompt_embeds: Optional[Union[bytes, list]],
                                enabled: bool) -> None:
    """Refuses prompt embeddings unless the server enables them.

    Checked before the payload is unpickled: a server that does not take
    embeddings has no reason to load them.

    Args:
        prompt_embeds: The request's `prompt_embeds`, if any.
        enabled: Whether the server runs with `--enable-prompt-embeds`.

    Raises:
        ValueError: naming the field and the flag.
    """
    if prompt_embeds and not enabled:
        raise ValueError("prompt_embeds are not accepted by this server (it "
                         "was not started with --enable-prompt-embeds).")
