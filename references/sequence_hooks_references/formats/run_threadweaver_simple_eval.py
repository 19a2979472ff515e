# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Runs ThreadWeaver's evaluation controller (`threadweaver_simple_eval`)
on stock vLLM in a process of its own and writes the answers as JSON.

Usage (in .venv-v1): python -m
    sequence_hooks_references.formats.run_threadweaver_simple_eval
    MODEL CASES.json OUT.json [--url URL]

CASES.json is a list of cases, each ``{"name", "prompts": [text],
"max_new_tokens": N or null}``, greedy unless ``"sampling"`` gives
`SamplingParams` fields. Offline (``LLM``, fp32, eager, the engine
settings of `run_threadweaver`) unless ``--url`` names a ``vllm serve``
of MODEL; the controller's context length is the window plus one.
"""

import dataclasses
import json
from typing import Any

from sequence_hooks_references.formats.apr_controller import TextCompletion
from sequence_hooks_references.formats.run_threadweaver import (backend_for,
                                                                runner_parser)
from sequence_hooks_references.formats.threadweaver_simple_eval import (
    SimpleEvalController, run)


class TokenPrompts:
    """Stock vLLM offline as the controller calls its server: token-id
    prompts in, text out.

    Args:
        backend: An `LLMBackend`.
    """

    def __init__(self, backend):
        self.backend = backend

    def generate_text(self, prompts: list[list[int]],
                      params: list[dict[str, Any]]) -> list[TextCompletion]:
        """Decodes every prompt with its parameters in one batch."""
        from vllm.inputs import TokensPrompt
        return self.backend.generate_text(
            [TokensPrompt(prompt_token_ids=prompt) for prompt in prompts],
            params)


def main() -> None:
    args = runner_parser(__doc__).parse_args()
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    backend = backend_for(args.model, args.url)
    # The completions API takes token-id prompts as they are.
    calls = backend if args.url else TokenPrompts(backend)
    results = []
    for case in json.loads(args.cases.read_text()):
        controller = SimpleEvalController(tokenizer, backend.max_model_len + 1,
                                          case.get("max_new_tokens"))
        rollouts = run(controller, calls, case["prompts"],
                       case.get("sampling"))
        results.append({
            "name": case["name"],
            "rollouts": [dataclasses.asdict(r) for r in rollouts]
        })
    args.out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
