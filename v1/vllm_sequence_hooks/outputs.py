# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The promise tree of a V1 `RequestOutput`, as the V0 fork gives it.

The engine core sends a finished root's tree to the frontend as plain data
(`PromiseNode.to_dict()` in `kv_transfer_params`, the one free-form field
V1 carries per request); this rebuilds the `PromiseNode` snapshot. The
root's text and logprobs are its request's own output's, which the
frontend makes (it detokenizes with the prompt as context; the engine core
does not), so they are taken from there rather than sent twice.

With `n > 1` the frontend runs one engine request per sample and gives the
request's output the `kv_transfer_params` of the last sample to finish;
the engine core therefore sends every finished sample's tree with each
later finishing sample (`SAMPLE_TREES_KEY`, by sample index), and a
sample's tree is found by its `CompletionOutput.index`.
"""

from typing import Optional

from vllm_sequence_hooks.transport import SAMPLE_TREES_KEY, TREE_KEY

from sequence_hooks import PromiseNode
from vllm import CompletionOutput, RequestOutput
from vllm.logprobs import Logprob


def promise_tree(
        output: RequestOutput,
        completion: Optional[CompletionOutput] = None
) -> Optional[PromiseNode]:
    """A sample's promise tree (V0's `CompletionOutput.promise_tree`).

    Args:
        output: A finished request's output; a cumulative one (as
            `LLM.generate` gives) for the root's text and logprobs.
        completion: The sample, one of ``output.outputs``; may be left
            out when there is only one (then also V0's
            `RequestOutput.promise_tree`).

    Returns:
        The sample's tree's root; None if it never promised or has not
        finished.
    """
    if completion is None:
        if len(output.outputs) != 1:
            return None
        completion = output.outputs[0]
    if not completion.finished():
        return None
    params = output.kv_transfer_params or {}
    data = params.get(SAMPLE_TREES_KEY, {}).get(str(completion.index))
    if data is None and len(output.outputs) == 1:
        # An `n == 1` request, or the sample's own streamed output.
        data = params.get(TREE_KEY)
    if data is None:
        return None
    root = PromiseNode.from_dict(data, Logprob)
    if len(completion.token_ids) != len(root.token_ids):
        # A delta (streamed) output: the engine core's text and no root
        # logprobs.
        return root
    # Built here, frozen to users afterwards (as `LiveNode.snapshot`).
    object.__setattr__(root, "text", completion.text)
    if completion.logprobs is not None and root.logprobs is None:
        # (A held root's are the engine core's: its output's are
        # made anew from them, with merged tokens' rows where it has none.)
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
