# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Trains a tiny Llama from scratch to write ThreadWeaver's format.

The task (models/threadweaver-toy, `threadweaver_task`): the last digit of
the product of 5-8 integers in [0, 1000], split by the prompt into
labelled groups; the model outlines them, its controller forks one thread
per label, and the model concludes from the threads' results.

As ThreadWeaver trains (threadweaver_sft/src/prefix_tree_utils_v1.py),
each task is one packed row: the sequence its controller ends with, then
every branch that sequence does not hold as decoded (the later threads,
whose joined headers differ, and any that hit EOS), each seeing only the
context it forked from, at the positions its own request has. The loss is
on what the model writes (headers, closures and suffixes are the
controller's).

Usage: .venv/bin/python training/research/train_threadweaver_model.py
    [--out DIR] [--steps 400] [--rows 4] [--lr 5e-3] [--layers 4] [--seed 0]
    [--init DIR]
"""

import random
from pathlib import Path

from sequence_hooks_testkit import tiny_model
from sequence_hooks_training import loop
from sequence_hooks_training import threadweaver_task as task_mod

ROOT = Path(__file__).resolve().parents[2]


def packed(tokenizer, task):
    """One task's row.

    Returns:
        (token ids, loss mask, position ids, and per token the context it
        sees: ``(fork, segment start)``, i.e. main tokens ``[0, fork)``
        plus its own segment from ``segment start`` on).
    """
    main, apart = task_mod.pieces(task)
    ids, mask, ends = [], [], []
    for piece in main:
        part = tokenizer.encode(piece.text, add_special_tokens=False)
        ids += part
        mask += [int(piece.trained)] * len(part)
        ends.append(len(ids))
    positions = list(range(len(ids)))
    sees = [(0, 0)] * len(ids)
    for fork, pieces in apart:
        start, seen = len(ids), ends[fork - 1]
        for piece in pieces:
            part = tokenizer.encode(piece.text, add_special_tokens=False)
            ids += part
            mask += [int(piece.trained)] * len(part)
        positions += range(seen, seen + len(ids) - start)
        sees += [(seen, start)] * (len(ids) - start)
    return ids, mask, positions, sees


def batch(tokenizer, rng: random.Random, rows: int, width: int, pending: list):
    """One step's rows: tasks packed one after the other (`loop.pack_rows`),
    each task seeing only itself."""
    return loop.pack_rows(tokenizer, rows, width, pending,
                          lambda: [packed(tokenizer, task_mod.make_task(rng))])


def main() -> None:
    args = loop.packed_toy_parser(__doc__,
                                  ROOT / "models" / "threadweaver-toy",
                                  400).parse_args()
    loop.train_packed_toy(args,
                          task_mod.build_tokenizer(),
                          batch,
                          tiny_model.MAX_POSITIONS,
                          tiny_model.MAX_POSITIONS,
                          every=25)


if __name__ == "__main__":
    main()
