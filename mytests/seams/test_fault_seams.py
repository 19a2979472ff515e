# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tripwires for the fault-tolerance modules: the upstream attributes
`request_checks` and the logits-processor guard read without a patch.
Each fails naming what moved. (The functions the hardening patches,
`patches/hardening/`, touch are checked with every patch's in
`test_seams.py`.)
"""


def test_upstream_attributes_the_checks_read():
    import dataclasses

    from vllm.engine.protocol import EngineClient
    from vllm.model_executor.guided_decoding.guidance_logits_processors import (  # noqa: E501
        GuidanceLogitsProcessor)
    from vllm.model_executor.guided_decoding.xgrammar_decoding import (
        GrammarConfig, XGrammarLogitsProcessor)
    from vllm.sampling_params import SamplingParams

    # request_checks.check_xgrammar_start compiles in the server.
    assert callable(XGrammarLogitsProcessor._ensure_ctx)
    assert {"config", "ctx", "tokenizer_info"
            } <= {f.name
                  for f in dataclasses.fields(XGrammarLogitsProcessor)}
    assert "regex_str" in {f.name for f in dataclasses.fields(GrammarConfig)}
    # ... and converts guidance's tokenizer into its class-level cache.
    assert isinstance(GuidanceLogitsProcessor.cached_tokenizers, dict)
    # The guard lets only these through when a processor fails.
    assert isinstance(SamplingParams.all_stop_token_ids, property)
    # The server asks the engine client whether hooks are on.
    assert callable(EngineClient.get_vllm_config)
