# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Runs a request's logits processors so that they cannot kill the engine.

Logits processors are request-supplied code (guided decoding, processors
named in a request body) that V0 runs inside the engine step, where any
exception is fatal to the engine and so to every other request. A
processor that raises, or that leaves no token that may be sampled (a
grammar that no token of the vocabulary can continue), ends its own
sequence instead: only the request's stop tokens stay allowed, so it
finishes with reason `stop` in this very step, and the engine carries on.
"""

from collections.abc import Collection
from typing import Callable

import torch

from vllm.logger import init_logger

logger = init_logger(__name__)


def apply_guarded(apply: Callable[..., torch.Tensor], logits_row: torch.Tensor,
                  stop_token_ids: Collection[int], *args) -> torch.Tensor:
    """Applies a sequence's logits processors, ending it if they fail.

    Args:
        apply: Applies the processors: `apply(logits_row, *args)`.
        logits_row: The sequence's logits for this step.
        stop_token_ids: Tokens that end the sequence (EOS included).
        *args: Passed on to `apply`.

    Returns:
        The processed row; if a processor raised or no token may be
        sampled after them, a row allowing only `stop_token_ids` (the row
        unchanged if there are none).
    """
    try:
        processed = apply(logits_row, *args)
    except Exception:
        logger.exception(
            "A logits processor of a request raised; the request's "
            "sequence ends here (finish reason 'stop').")
        return _only(logits_row, stop_token_ids)
    if not torch.isfinite(processed).any():
        logger.warning(
            "A request's logits processors allow no token (e.g. a grammar "
            "that no token of the vocabulary continues); the sequence ends "
            "here (finish reason 'stop').")
        return _only(processed, stop_token_ids)
    return processed


def _only(logits_row: torch.Tensor,
          token_ids: Collection[int]) -> torch.Tensor:
    """`logits_row` with every token but `token_ids` masked out."""
    ids = [i for i in token_ids if 0 <= i < logits_row.shape[-1]]
    if not ids:
        return logits_row
    row = torch.full_like(logits_row, -float("inf"))
    row[ids] = 0.0
    return row
