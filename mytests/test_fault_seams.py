# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tripwires for the fault-tolerance patches (0006-0009) and modules.

The upstream functions those patches touch, as pristine upstream has them,
and the upstream attributes `request_checks` and the logits-processor
guard read without a patch. Each fails naming what moved.
"""

import ast

import build_fork
import pytest

# Upstream file -> {function (Class.method or module function): params}.
PATCHED = {
    "vllm/model_executor/layers/logits_processor.py": {
        "_apply_logits_processors": ["logits", "sampling_metadata"],
        "_apply_logits_processors_single_seq": [
            "logits_row", "logits_processors", "past_tokens_ids",
            "prompt_tokens_ids"
        ],
    },
    "vllm/engine/llm_engine.py": {
        "LLMEngine._validate_model_input":
        ["self", "prompt_inputs", "lora_request", "prompt_type"],
    },
    "vllm/entrypoints/openai/serving_engine.py": {
        "OpenAIServing._normalize_prompt_text_to_input": [
            "self", "request", "tokenizer", "prompt", "truncate_prompt_tokens",
            "add_special_tokens"
        ],
        "OpenAIServing._normalize_prompt_tokens_to_input": [
            "self", "request", "tokenizer", "prompt_ids",
            "truncate_prompt_tokens"
        ],
        "OpenAIServing._load_prompt_embeds":
        ["self", "prompt_embeds", "truncate_prompt_tokens"],
    },
    "vllm/entrypoints/openai/serving_completion.py": {
        "OpenAIServingCompletion.create_completion":
        ["self", "request", "raw_request"],
    },
    "vllm/entrypoints/openai/serving_chat.py": {
        "OpenAIServingChat.create_chat_completion":
        ["self", "request", "raw_request"],
    },
    "vllm/entrypoints/llm.py": {
        "LLM.beam_search":
        ["self", "prompts", "params", "lora_request", "use_tqdm"],
    },
    "vllm/engine/async_llm_engine.py": {
        "build_guided_decoding_logits_processor_async": [
            "sampling_params", "tokenizer", "default_guided_backend",
            "reasoning_backend", "model_config"
        ],
    },
}


def parameters(node) -> list[str]:
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    names += [a.arg for a in (args.vararg, args.kwarg) if a]
    return names


def upstream_functions(relative_path: str) -> dict[str, list[str]]:
    """Module functions and methods of a pristine upstream file."""
    tree = ast.parse(
        (build_fork.pristine_tree("cpu") / relative_path).read_text())
    found = {}
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, functions):
            found[node.name] = parameters(node)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, functions):
                    found[f"{node.name}.{item.name}"] = parameters(item)
    return found


@pytest.mark.parametrize("relative_path", sorted(PATCHED))
def test_patched_functions_have_their_upstream_shape(relative_path):
    found = upstream_functions(relative_path)
    for name, params in PATCHED[relative_path].items():
        assert name in found, f"upstream {relative_path} lost {name}"
        assert found[name] == params, f"upstream {name} changed shape"


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
