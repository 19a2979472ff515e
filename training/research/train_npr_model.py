# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Trains a tiny Llama from scratch to write NPR's format.

The task (models/npr-toy, `npr_task`): the last letters of 2 to 4 words,
one step per word, each spelling its word (steps of different lengths),
the takeaway listing the steps' results; a single word is answered with
no block. Each sequence is trained under the layout NPR trains with
(`parallel_layout_training`): its 4-D mask and position ids from its own
token ids, the loss on what the model samples.

Usage: .venv/bin/python training/research/train_npr_model.py [--out DIR]
    [--steps 800] [--rows 4] [--width 320] [--lr 3e-3] [--layers 4]
    [--hidden 128] [--replaced 0.2] [--seed 0] [--init DIR]
"""

from pathlib import Path

import parallel_layout_training as common

from sequence_hooks_references.parallel_layout import NPR
from sequence_hooks_training import npr_task

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    args = common.parser(__doc__, ROOT / "models" / "npr-toy", 800,
                         320).parse_args()
    common.train_toy(args, npr_task.build_tokenizer(), NPR, npr_task)


if __name__ == "__main__":
    main()
