# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A whole promise tree as one training row (tree packing).

Per-node rows repeat a parent's whole context in every child's row, and
the trainer computes it again for each; the engine computed it once. A
packed row holds every node of a tree once: the prompt, the root's tokens
(merged ones included, as context), then each child's segment, parents
before children. Each token attends only to the tokens it was generated
after (its ancestors' tokens up to where its branch forked, and its own
node's earlier tokens), at the position it had in generation, so every
token gets the logprob it gets in its own node's row.

A child's segment starts with its head: the last token of its context (the
role marker, or without one a copy of the parent's token before the
fork), placed after the parent's last visible token. The head predicts
the child's first token; it is context, never trained (mask 0), so the
segment's other tokens are predicted by the token just before them, as
in any row.

The layout of a row is one index per completion token, the token it
follows in its context (`prev`): the one before it in its node, the
head's anchor in its parent, `PROMPT` for the root's first token (the
prompt's last), `PAD` for padding. Positions and the attention mask
follow from it (`tree_attention`).
"""

from dataclasses import dataclass

import torch

from sequence_hooks.training_records import SequenceRecord

# `prev` of the root's first token: it follows the prompt's last token.
PROMPT = -1
# `prev` of a padding token: it follows nothing and attends to itself.
PAD = -2


@dataclass(frozen=True)
class PackedTree:
    """One tree as a completion row."""

    # The root's tokens, then each child's head and tokens.
    completion_ids: list[int]
    # The engine's logprob of each sampled token; 0.0 for merged tokens
    # and heads.
    logprobs: list[float]
    # 1 for sampled tokens (trained), 0 for merged tokens and heads.
    mask: list[int]
    # Per token, the index of the token it follows (`PROMPT`).
    prev: list[int]
    # The root's own tokens (the first of ``completion_ids``).
    root_length: int


def pack_tree(prompt_length: int, root: tuple[list[int], list[float],
                                              list[int]],
              children: list[SequenceRecord]) -> PackedTree:
    """Packs a tree into one completion row.

    Args:
        prompt_length: The root's prompt's tokens.
        root: The root's completion ids, logprobs and mask (`node_row`).
        children: The tree's other nodes, parents before their children
            (`training_records`' order); one with no tokens (aborted
            before it sampled) is left out.

    Returns:
        The packed row.
    """
    ids, logprobs, mask = (list(part) for part in root)
    prev = list(range(PROMPT, len(ids) - 1))
    # Per node: its first token's index, its head's, its context's length.
    # A parent not placed yet is the root (parents come first).
    placed: dict[str, tuple[int, int, int]] = {}
    for record in children:
        if not record.token_ids:
            continue
        start, head, context = placed.get(record.parent_id,
                                          (0, PROMPT, prompt_length))
        # The parent's tokens this child saw before its head.
        seen = len(record.context_token_ids) - 1 - context
        prev.append(start + seen - 1 if seen else head)
        head = len(ids)
        ids.append(record.context_token_ids[-1])
        logprobs.append(0.0)
        mask.append(0)
        own_ids, own_logprobs, own_mask = node_row(record)
        prev += list(range(head, head + len(own_ids)))
        placed[record.request_id] = (head + 1, head,
                                     len(record.context_token_ids))
        ids += own_ids
        logprobs += own_logprobs
        mask += own_mask
    return PackedTree(ids, logprobs, mask, prev, len(root[0]))


def node_row(
        record: SequenceRecord) -> tuple[list[int], list[float], list[int]]:
    """A record's completion ids, logprobs (0.0 where merged) and mask."""
    return (list(record.token_ids),
            [0.0 if lp is None else lp for lp in record.logprobs
             ], [int(sampled) for sampled in record.sampled_mask])


def pad_layouts(prevs: list[list[int]]) -> torch.Tensor:
    """Rows' `prev` lists as one tensor, right-padded with `PAD` to the
    longest (as TRL pads the completions)."""
    layout = torch.full((len(prevs), max(map(len, prevs))),
                        PAD,
                        dtype=torch.long)
    for row, prev in enumerate(prevs):
        layout[row, :len(prev)] = torch.tensor(prev, dtype=torch.long)
    return layout


def fit(layout: torch.Tensor, width: int) -> torch.Tensor:
    """``layout`` right-padded with `PAD` to ``width`` columns (TRL pads
    completions to a multiple when `pad_to_multiple_of` is set)."""
    return torch.nn.functional.pad(layout, (0, width - layout.size(1)),
                                   value=PAD)


def tree_attention(prompt_mask: torch.Tensor, layout: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention mask and positions of packed rows.

    Args:
        prompt_mask: (rows, P), 1 on the prompts' tokens (left-padded).
        layout: (rows, C), each completion token's `prev`.
        dtype: The model's dtype (the mask is added to its scores).

    Returns:
        An additive mask (rows, 1, P + C, P + C): 0 where a token may
        attend (itself, the prompt before it, the completion tokens it
        follows, transitively), the dtype's minimum elsewhere; and the
        positions (rows, P + C), as in generation (the prompt's first
        token at 0).
    """
    rows, width = prompt_mask.shape
    length = width + layout.size(1)
    seen = torch.eye(length, dtype=torch.bool).repeat(rows, 1, 1)
    positions = torch.zeros(rows, length, dtype=torch.long)
    for row in range(rows):
        real = int(prompt_mask[row].sum())
        first = width - real
        seen[row, first:width,
             first:width] = torch.ones(real, real, dtype=torch.bool).tril()
        positions[row, first:width] = torch.arange(real)
        for index, before in enumerate(layout[row].tolist(), start=width):
            if before == PAD:
                continue
            anchor = width + before
            seen[row, index] |= seen[row, anchor]
            positions[row, index] = positions[row, anchor] + 1
    mask = torch.zeros(rows, 1, length, length, dtype=dtype)
    return mask.masked_fill_(~seen[:, None], torch.finfo(dtype).min), positions


def node_sums(values: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
    """Per token, the sum of ``values`` over its node (a node's head
    counts to the node it starts; a padding token is a node of its own).

    Args:
        values: (rows, C), one value per completion token.
        layout: (rows, C), their `prev`.

    Returns:
        (rows, C): each token's node's sum, what a per-node row's
        sequence-level sum would be.
    """
    follows = layout == torch.arange(-1,
                                     layout.size(1) - 1,
                                     device=layout.device)
    nodes = torch.cumsum(~follows, dim=1)
    sums = torch.zeros_like(values).scatter_add_(1, nodes, values)
    return sums.gather(1, nodes)
