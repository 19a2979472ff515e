# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The promise tree of a V1 `RequestOutput`, as the V0 fork gives it.

The engine core sends a finished root's tree to the frontend as plain data
(`PromiseNode.to_dict()` in `kv_transfer_params`, the one free-form field
V1 carries per request); this rebuilds the `PromiseNode` snapshot. The
root's text and logprobs are its request's own output's, which the
frontend makes (it detokenizes with the prompt as context; the engine core
does not), so they are taken from there rather than sent twice.
"""

from typing import Optional

from vllm_sequence_hooks.scheduler import TREE_KEY

from sequence_hooks import PromiseNode
from vllm import RequestOutput
from vllm.logprobs import Logprob


def promise_tree(output: RequestOutput) -> Optional[PromiseNode]:
    """The request's promise tree (V0's `RequestOutput.promise_tree`).

    Args:
        output: A finished request's output; a cumulative one (as
            `LLM.generate` gives) for the root's text and logprobs.

    Returns:
        The tree's root; None if the request never promised, is not
        finished, or has `n > 1` samples (as on V0: each sample has its
        own tree, which reaches the frontend with that sample's final
        output; aggregated outputs keep only the last one's).
    """
    data = (output.kv_transfer_params or {}).get(TREE_KEY)
    if data is None or len(output.outputs) != 1:
        return None
    root = PromiseNode.from_dict(data, Logprob)
    completion = output.outputs[0]
    if len(completion.token_ids) != len(root.token_ids):
        # A delta (streamed) output: the engine core's text and no root
        # logprobs.
        return root
    # Built here, frozen to users afterwards (as `TreeNode.snapshot`).
    object.__setattr__(root, "text", completion.text)
    if completion.logprobs is not None:
        merged = {
            i
            for start, count in root.merged_spans
            for i in range(start, start + count)
        }
        object.__setattr__(
            root, "logprobs",
            tuple(None if i in merged else entry
                  for i, entry in enumerate(completion.logprobs)))
        object.__setattr__(root, "cumulative_logprob",
                           completion.cumulative_logprob)
    return root
