# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-sequence training records from promise trees (RL rollouts).

Each sequence of a tree becomes one record: the context it was generated
from, the tokens it produced, which of them it sampled (merged tokens were
given by the engine, not sampled), their logprobs and its parent. This is
the shape an RL trainer consumes: loss on sampled tokens only, the context
as the prompt.
"""

from dataclasses import dataclass
from typing import Optional

from sequence_hooks.tree import PromiseNode


@dataclass(frozen=True)
class SequenceRecord:
    """One sequence of a promise tree, ready for training."""

    # The sequence's request id (`<root id>/promise-<k>` for children).
    request_id: str
    # Its parent's request id; None for the root.
    parent_id: Optional[str]
    # The tokens it was generated from: the prompt for the root; for a
    # child, its parent's context and first `fork_position` tokens, and the
    # role marker, if configured.
    context_token_ids: tuple[int, ...]
    # The tokens it produced (merged ones included).
    token_ids: tuple[int, ...]
    # Per token, whether the sequence sampled it after these ids (False:
    # merged, or with logprobs asked, one that has none).
    sampled_mask: tuple[bool, ...]
    # Per token, the sampled token's logprob; None for merged tokens, and
    # None altogether unless the request asked for logprobs.
    logprobs: Optional[tuple[Optional[float], ...]]
    # "stop", "length" or "abort".
    finish_reason: Optional[str]


def training_records(prompt_token_ids: list[int], tree: PromiseNode,
                     role_marker_id: Optional[int]) -> list[SequenceRecord]:
    """Flattens a finished promise tree into records, parents first.

    Args:
        prompt_token_ids: The request's prompt token ids.
        tree: The root of the request's (or one sample's) promise tree.
        role_marker_id: The `child_role_token_id` the engine was configured
            with, appended to every child's context; None if none.

    Returns:
        One record per sequence, depth first in promise order.

    Raises:
        ValueError: The tree is a format's (its children are labelled):
            their contexts hold the format's headers or fresh prompts,
            which the tree does not carry (docs/formats.md).
    """
    if any(child.label is not None for child in tree.children):
        raise ValueError(
            "training_records flattens promise/sync trees; a format's "
            "children (labelled) start from headers or fresh prompts the "
            "tree does not carry (docs/formats.md, 'Training on a "
            "format's trees')")
    marker = () if role_marker_id is None else (role_marker_id, )
    records: list[SequenceRecord] = []

    def visit(node: PromiseNode, context: tuple[int, ...]) -> None:
        logprobs, mask = None, node.sampled_mask
        if node.logprobs is not None:
            logprobs = tuple(
                None if entry is None else entry[token].logprob
                for token, entry in zip(node.token_ids, node.logprobs))
            # A token with no logprob was not sampled after these ids (a
            # format's re-tokenized text, APR's): not trained either.
            mask = tuple(sampled and logprob is not None
                         for sampled, logprob in zip(mask, logprobs))
        records.append(
            SequenceRecord(
                node.request_id,
                None if node.parent is None else node.parent.request_id,
                context, node.token_ids, mask, logprobs, node.finish_reason))
        for child in node.children:
            visit(child,
                  context + node.token_ids[:child.fork_position] + marker)

    visit(tree, tuple(prompt_token_ids))
    return records
