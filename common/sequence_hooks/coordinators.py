# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The coordinator an engine runs for its `special_kwargs`: the
promise/sync lifecycle, or a published format's (`format_lifecycle`)."""

from typing import Any

from sequence_hooks.actions import EngineQueries
from sequence_hooks.apr import APRFormat
from sequence_hooks.apr_lifecycle import APRCoordinator
from sequence_hooks.format_lifecycle import FormatCoordinator
from sequence_hooks.lifecycle import PromiseCoordinator
from sequence_hooks.special_kwargs import PROMISE_SYNC, SpecialKwargs
from sequence_hooks.threadweaver import ThreadWeaverFormat


def coordinator_for(special_kwargs: SpecialKwargs,
                    queries: EngineQueries,
                    max_model_len: int,
                    tokenizer: Any,
                    metrics=None) -> PromiseCoordinator:
    """The coordinator of an engine's trees in its configured format.

    Args:
        special_kwargs: The hook configuration, resolved to ids (its
            ``format`` checked at start: `checked_special_kwargs`).
        queries: What the coordinator asks the engine (read-only).
        max_model_len: The engine's longest sequence.
        tokenizer: The engine's (Hugging Face) tokenizer.
        metrics: The hook metrics (`SequenceHookMetrics`), if exported.

    Returns:
        A `PromiseCoordinator` for promise/sync, a `FormatCoordinator`
        for ThreadWeaver's format, an `APRCoordinator` for APR's.
    """
    if special_kwargs.format == PROMISE_SYNC:
        return PromiseCoordinator.for_tokenizer(special_kwargs, queries,
                                                max_model_len, tokenizer,
                                                metrics)
    if special_kwargs.format == "apr":
        return APRCoordinator(APRFormat.for_tokenizer(tokenizer),
                              special_kwargs, queries, max_model_len, metrics)
    # None: ThreadWeaver's released setting, no conclusion.
    no_conclusion = special_kwargs.no_conclusion is not False
    threadweaver = ThreadWeaverFormat.for_tokenizer(tokenizer,
                                                    special_kwargs.tags,
                                                    no_conclusion)
    return FormatCoordinator(threadweaver, special_kwargs, queries,
                             max_model_len, metrics)
