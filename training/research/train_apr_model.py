# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Trains a tiny Llama from scratch to write APR's Countdown traces.

The task (models/apr-toy, `apr_task`): Countdown with 4 numbers and a
target in [10, 100], searched as APR's generator searches it (small
beams; the parent calls one sub-search per node it generates at the
root).

As APR trains (src/data/generate_apr.py collects `main_calls` and every
`sub_calls` trace), each of the parent's calls and each child is a
training sequence of its own, from its own fresh prompt; sequences are
packed into rows, each seeing only itself, its positions from 0. The loss
is on what the model writes: not on the prompt, not on the
``<Sub Searches>`` ... ``<End Sub Searches>`` block the controller joins.

Usage: .venv/bin/python training/research/train_apr_model.py [--out DIR]
    [--steps 480] [--rows 4] [--width 1024] [--lr 5e-3] [--layers 4]
    [--seed 0] [--init DIR]
"""

import random
from pathlib import Path

from sequence_hooks_training import apr_task, loop

ROOT = Path(__file__).resolve().parents[2]
# Room for a parent's trace and its joins (its longest training sequence
# is about 800 tokens).
MAX_POSITIONS = 2048


def encoded(tokenizer, pieces) -> tuple[list[int], list[int]]:
    """A sequence's token ids and loss mask (1 where the model writes).

    The pieces are encoded apart: every boundary between them is one
    where ``encode`` is additive (`apr_task.build_tokenizer`), so these
    are the ids of the whole text.
    """
    ids: list[int] = [tokenizer.bos_token_id]
    mask = [0]
    for piece in pieces:
        part = tokenizer.encode(piece.text, add_special_tokens=False)
        ids += part
        mask += [int(piece.trained)] * len(part)
    return ids, mask


def batch(tokenizer, rng: random.Random, rows: int, width: int, pending: list):
    """One step's rows: a task's sequences packed one after the other
    (`loop.pack_rows`), each seeing only itself from position 0."""

    def refill() -> list:
        search = apr_task.random_search(apr_task.make_task(rng), rng)
        return [(ids, mask, list(range(len(ids))), [(0, 0)] * len(ids))
                for ids, mask in (encoded(tokenizer, q)
                                  for q in search.sequences())]

    return loop.pack_rows(tokenizer, rows, width, pending, refill)


def main() -> None:
    parser = loop.packed_toy_parser(__doc__, ROOT / "models" / "apr-toy", 480)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    loop.train_packed_toy(args,
                          apr_task.build_tokenizer(),
                          batch,
                          args.width,
                          MAX_POSITIONS,
                          every=10)


if __name__ == "__main__":
    main()
