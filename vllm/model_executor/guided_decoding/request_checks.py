# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Guided-decoding requests that cannot be served fail in the server.

vLLM 0.9.2 validates xgrammar's JSON schemas and grammars in the server,
but compiles xgrammar's regexes and converts the tokenizer for guidance
only inside the engine step, where a failure is fatal to the engine (see
`logits_processor_guard` for the net under that). And the backends raise
their own exception types (interegular's `InvalidSyntax`, lark's
`GrammarError`), which the server answers with a 500 and often an empty
message. Here every failure to build a request's processor becomes a
`ValueError` naming the backend and the guided-decoding field, which the
server returns as a 400, before anything reaches the engine.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.sampling_params import GuidedDecodingParams

# GuidedDecodingParams fields, in the order the backends look at them.
FIELDS = ("json", "regex", "choice", "grammar", "json_object",
          "structural_tag")


def guided_field(guided_params: "GuidedDecodingParams") -> str:
    """The guided-decoding field a request set (e.g. "regex")."""
    for name in FIELDS:
        if getattr(guided_params, name, None) is not None:
            return name
    return "?"


@contextmanager
def as_request_error(guided_params: "GuidedDecodingParams") -> Iterator[None]:
    """Re-raises any error building the processor as a `ValueError`.

    Args:
        guided_params: The request's guided-decoding parameters (their
            backend after any fallback).

    Raises:
        ValueError: naming the backend, the field and the cause.
    """
    try:
        yield
    except Exception as e:
        detail = str(e).strip() or "it could not be parsed"
        raise ValueError(
            f"guided decoding (backend {guided_params.backend!r}, "
            f"{guided_field(guided_params)}): {type(e).__name__}: {detail}"
        ) from e


def check_processor(processor: object, tokenizer: object) -> None:
    """Does the work a processor would first do inside the engine step.

    Args:
        processor: The guided-decoding logits processor just built.
        tokenizer: The request's tokenizer.

    Raises:
        Exception: whatever the backend raises for a regex it cannot
            compile, a tokenizer it cannot convert or a grammar it
            refuses.
    """
    # Imported here: each backend is imported only when a request uses it.
    from vllm.model_executor.guided_decoding import (
        guidance_logits_processors, xgrammar_decoding)
    if isinstance(processor, xgrammar_decoding.XGrammarLogitsProcessor):
        check_xgrammar_start(processor)
    elif isinstance(processor,
                    guidance_logits_processors.GuidanceLogitsProcessor):
        import llguidance
        import llguidance.hf
        cache = processor.cached_tokenizers
        if processor.tokenizer_name not in cache:
            try:
                cache[processor.tokenizer_name] = (
                    llguidance.hf.from_tokenizer(tokenizer, None))
            except Exception as e:
                raise ValueError("the backend cannot use this model's "
                                 f"tokenizer ({e})") from e
        error = llguidance.LLMatcher.validate_grammar(
            processor.grammar, cache[processor.tokenizer_name])
        if error:
            raise ValueError(error)


def check_xgrammar_start(processor) -> None:
    """Compiles an xgrammar processor's grammar and checks its first step.

    The compiled grammar is cached per tokenizer in this process and is not
    sent to the engine (the processor pickles only its configuration).

    Args:
        processor: An `XGrammarLogitsProcessor` just built.

    Raises:
        ValueError: if no token of the vocabulary can begin the output
            the grammar requires (JSON on a vocabulary without "{").
        RuntimeError: from xgrammar, for a regex it cannot compile.
    """
    from vllm.model_executor.guided_decoding.xgrammar_decoding import xgr
    processor._ensure_ctx()
    matcher = xgr.GrammarMatcher(processor.ctx)
    bitmask = xgr.allocate_token_bitmask(1,
                                         processor.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    if not bitmask.any():
        raise ValueError("no token of this model's vocabulary can begin the "
                         "output it requires")
