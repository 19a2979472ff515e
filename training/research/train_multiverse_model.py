# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Trains a tiny Llama from scratch to write Multiverse's format.

The task (models/multiverse-toy, `multiverse_task`): the last letters of
2 to 4 items, an item a word or a pair of words; one path per item, a
word's path spelling it (paths of different lengths), a pair's path
opening a nested block of two paths; the conclusion lists the paths'
results; a single word is answered with no block. Each sequence is
trained under the layout Multiverse trains with
(`parallel_layout_training`): its 4-D mask and position ids from its own
token ids, the loss on what the model samples.

Usage: .venv/bin/python training/research/train_multiverse_model.py
    [--out DIR] [--steps 1500] [--rows 4] [--width 400] [--lr 3e-3]
    [--layers 4] [--hidden 128] [--replaced 0.2] [--seed 0] [--init DIR]
"""

from pathlib import Path

import parallel_layout_training as common

from sequence_hooks_references.parallel_layout import MULTIVERSE
from sequence_hooks_training import multiverse_task

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    args = common.parser(__doc__, ROOT / "models" / "multiverse-toy", 1500,
                         400).parse_args()
    common.train_toy(args, multiverse_task.build_tokenizer(), MULTIVERSE,
                     multiverse_task)


if __name__ == "__main__":
    main()
