# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The `promise_tree` field of OpenAI-API choices (sequence hooks).

A request with `"return_promise_tree": true` gets, in each choice whose
output has finished (a stream's final chunk of that choice), the output's
promise tree as JSON (`PromiseNode.to_dict`), or null if it never promised.
Response models allow extra fields, so a request without the flag gets
responses with no trace of it.
"""

from typing import Any

from vllm.outputs import CompletionOutput


def promise_tree_field(request: Any, output: CompletionOutput) -> dict:
    """Extra keyword arguments for a response choice.

    Args:
        request: The completion or chat completion request.
        output: The engine's output behind the choice.

    Returns:
        `{"promise_tree": ...}` for a finished output of a request that asked
        for it, else `{}`.
    """
    if not getattr(request, "return_promise_tree",
                   False) or output.finish_reason is None:
        return {}
    tree = output.promise_tree
    return {"promise_tree": None if tree is None else tree.to_dict()}
