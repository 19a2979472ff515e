# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Request options that sequence hooks cannot serve, refused with a reason.

Each would otherwise turn the hooks off without a word: the request would
run, and its `<promise>` and `<sync>` tokens would stay plain text. The
OpenAI server calls `check_request_options` where it turns a request into
sampling parameters (a `ValueError` there becomes a 400), and
`LLM.beam_search` calls it before it starts.
"""

from typing import TYPE_CHECKING, Union

from vllm.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from vllm.config import VllmConfig

BEAM_SEARCH = (
    "use_beam_search cannot be used with sequence hooks (this server runs "
    "with special_kwargs): beam search runs every step as its own one-token "
    "request, so a <promise> can never spawn a child nor a <sync> merge "
    "one. Use sampling instead (n, best_of, seed).")
GUIDED_DECODING = (
    "guided decoding (response_format json_object/json_schema/"
    "structural_tag, guided_json, guided_regex, guided_choice, "
    "guided_grammar, or a tool_choice that forces a tool call) cannot be "
    "used with sequence hooks (this server runs with special_kwargs): the "
    "grammar forbids the <promise> and <sync> tokens, and the children's "
    "text merged into a parent is never checked against it.")


def check_request_options(params: Union[SamplingParams, BeamSearchParams],
                          vllm_config: "VllmConfig") -> None:
    """Refuses options that a hooked engine would serve without hooks.

    Args:
        params: The request's sampling or beam search parameters.
        vllm_config: The engine's configuration; nothing is refused
            without `special_kwargs`.

    Raises:
        ValueError: naming the option and why.
    """
    if vllm_config.special_kwargs is None:
        return
    if isinstance(params, BeamSearchParams):
        raise ValueError(BEAM_SEARCH)
    if params.guided_decoding is not None:
        raise ValueError(GUIDED_DECODING)
