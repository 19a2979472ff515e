# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Trains a tiny Llama that speaks promise/sync on a parallel task.

The task ("expand"): the prompt lists k groups of 5 words, separated by
"then". The parent writes one `<promise>` per group, then `<sync>`. The
child of the i-th promise (it starts with `<child>`) writes every word of
group i four times (20 words), then "so" and its answer, the group's first
word, and ends. The engine merges the children's texts into the parent,
whose conclusion lists the answers it reads there. In training, some
answers the parent sees are replaced by random words (and its conclusion
follows them), so it learns to read the merged results instead of working
them out from its prompt. Every answer is checkable by a program, and
children write enough tokens for parallelism to matter.

Usage: .venv/bin/python training/research/train_promise_model.py [--out DIR]
    [--steps 2500] [--seed 0]
"""

import argparse
import random
from pathlib import Path

import torch

from sequence_hooks_testkit import tiny_model
from sequence_hooks_training import loop
from sequence_hooks_training.expand_task import examples, make_task

ROOT = Path(__file__).resolve().parents[2]


def batches(tokenizer, rng: random.Random, size: int):
    """One training step's rows, as (tokens, loss mask) tensors.

    Parents' rows (which hold the merged text) are about twice as long as
    children's; padding each kind to its own width saves a third of the
    compute.

    Args:
        tokenizer: The tiny word-level tokenizer.
        rng: The source of the tasks.
        size: Tasks per step.

    Returns:
        An iterator of two (tokens, loss mask) pairs of tensors.
    """
    rows = sorted((row for _ in range(size)
                   for row in examples(tokenizer, make_task(rng), rng)),
                  key=lambda row: len(row[0]))
    pad = tokenizer.pad_token_id
    half = len(rows) // 2
    for part in (rows[:half], rows[half:]):
        width = max(len(t) for t, _ in part)
        yield (torch.tensor([t + [pad] * (width - len(t)) for t, _ in part]),
               torch.tensor([m + [0] * (width - len(m)) for _, m in part]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "models" / "expand"))
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    out = Path(args.out)
    spec = tiny_model.TinyModelSpec(seed=args.seed,
                                    num_layers=4,
                                    weight_scale=1.0)
    tiny_model.build_tiny_model(out, spec)
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(out)
    tokenizer = tiny_model.build_tokenizer()

    def loss_of() -> torch.Tensor:
        losses, weights = [], 0.0
        for tokens, mask in batches(tokenizer, rng, 16):
            losses.append(
                loop.masked_loss_sum(model(tokens).logits, tokens, mask))
            weights += mask[:, 1:].float().sum()
        return sum(losses) / weights

    loop.train(model, args.steps, 3e-3, loss_of, every=200)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    print(f"saved to {out}")


if __name__ == "__main__":
    main()
