# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A packed tree (`vllm_sequence_hooks_rl.packing`), model-free: every
token attends exactly to what it was generated after, at the position it
had in generation, with a role marker and without; per-node sums are the
nodes'. (That a packed row's loss and gradients equal per-node rows' on
the real model's trees: test_rl_trees.py.)"""

import pytest
import torch
from vllm_sequence_hooks_rl.packing import (PAD, node_row, node_sums,
                                            pack_tree, pad_layouts,
                                            tree_attention)

from sequence_hooks.training_records import SequenceRecord

PROMPT = (10, 11, 12)
PROMISE, SYNC, MARKER = 90, 91, 99
# The root promises twice, syncs (two merged tokens) and concludes; its
# first child promises a grandchild; a third child was aborted unsampled.
ROOT = (20, PROMISE, 21, PROMISE, 22, SYNC, 30, 50, 23)
ROOT_SAMPLED = (True, ) * 6 + (False, False, True)


def records(marker: tuple[int, ...]) -> list[SequenceRecord]:

    def record(name, parent, context, tokens):
        return SequenceRecord(name, parent, tuple(context), tuple(tokens),
                              (True, ) * len(tokens),
                              tuple(-0.5 for _ in tokens), "stop")

    first = PROMPT + ROOT[:2] + marker
    return [
        SequenceRecord("r", None, PROMPT, ROOT, ROOT_SAMPLED,
                       tuple(-0.1 if s else None for s in ROOT_SAMPLED),
                       "stop"),
        record("r/1", "r", first, (30, PROMISE, 31, SYNC, 40)),
        record("r/1/1", "r/1", first + (30, PROMISE) + marker, (40, 41)),
        record("r/2", "r", PROMPT + ROOT[:4] + marker, (50, 51)),
        record("r/3", "r", PROMPT + ROOT[:4] + marker, ()),
    ]


@pytest.mark.parametrize("marker", [(MARKER, ), ()])
def test_each_token_sees_what_it_was_generated_after(marker):
    tree = records(marker)
    packed = pack_tree(len(PROMPT), node_row(tree[0]), tree[1:])
    # What each packed token was generated after, and itself: a node's
    # head is its context's last token.
    expected = [PROMPT + ROOT[:k + 1] for k in range(len(ROOT))]
    for record in tree[1:4]:
        expected.append(record.context_token_ids)
        expected += [
            record.context_token_ids + record.token_ids[:k + 1]
            for k in range(len(record.token_ids))
        ]
    assert len(packed.completion_ids) == len(expected)
    assert packed.root_length == len(ROOT)
    assert packed.mask == [int(s) for s in ROOT_SAMPLED
                           ] + [0, 1, 1, 1, 1, 1] + [0, 1, 1] + [0, 1, 1]
    assert packed.logprobs[:len(ROOT)] == [
        -0.1 if s else 0.0 for s in ROOT_SAMPLED
    ]
    # Two pad tokens left of the prompt, one right of the completion.
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1]])
    layout = pad_layouts([packed.prev + [PAD]])
    mask, positions = tree_attention(prompt_mask, layout, torch.float32)
    ids = [0, 0, *PROMPT, *packed.completion_ids, 0]
    for index, seen in enumerate(expected, start=5):
        visible = (mask[0, 0, index] == 0).nonzero()[:, 0].tolist()
        ordered = sorted(visible, key=lambda j: int(positions[0, j]))
        assert tuple(ids[j] for j in ordered) == seen, index
        assert [int(positions[0, j])
                for j in ordered] == list(range(len(seen)))
    # The prompt's own tokens are causal; padding sees only itself.
    assert (mask[0, 0, 3] == 0).nonzero()[:, 0].tolist() == [2, 3]
    for pad in (0, 1, len(ids) - 1):
        assert (mask[0, 0, pad] == 0).nonzero()[:, 0].tolist() == [pad]


def test_node_sums_are_each_nodes_sum():
    tree = records((MARKER, ))
    packed = pack_tree(len(PROMPT), node_row(tree[0]), tree[1:])
    layout = pad_layouts([packed.prev, packed.prev[:len(ROOT)]])
    values = torch.ones(layout.shape)
    # The root's 9 tokens, each child's head and tokens, a padding token.
    expected = [[9.0] * 9 + [6.0] * 6 + [3.0] * 3 + [3.0] * 3,
                [9.0] * 9 + [1.0] * 12]
    assert node_sums(values, layout).tolist() == expected
