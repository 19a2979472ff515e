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

Usage: .venv/bin/python models/research/train_threadweaver_model.py
    [--out DIR] [--steps 400] [--rows 4] [--lr 5e-3] [--layers 4] [--seed 0]
    [--init DIR]
"""

import argparse
import random
import time
from pathlib import Path

import torch

from sequence_hooks_testkit import tiny_model
from sequence_hooks_testkit.training import loop
from sequence_hooks_testkit.training import threadweaver_task as task_mod

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
    """One step's rows: tasks packed one after the other into ``rows``
    rows of ``width`` tokens (no padding between them), each task seeing
    only itself. ``pending`` carries a task that did not fit over to the
    next step.

    Returns:
        Tokens, loss mask, positions, and the boolean attention mask
        (rows, 1, width, width).
    """
    tokens = torch.full((rows, width), tokenizer.pad_token_id)
    loss = torch.zeros((rows, width))
    positions = torch.zeros((rows, width), dtype=torch.long)
    # Padding sees itself only, so no row of the mask is empty.
    attend = torch.eye(width, dtype=torch.bool).repeat(rows, 1, 1)
    for b in range(rows):
        offset = 0
        while True:
            if not pending:
                pending.append(packed(tokenizer, task_mod.make_task(rng)))
            ids, mask, pos, sees = pending[0]
            if offset + len(ids) > width:
                break
            pending.pop()
            end = offset + len(ids)
            tokens[b, offset:end] = torch.tensor(ids)
            loss[b, offset:end] = torch.tensor(mask, dtype=torch.float)
            positions[b, offset:end] = torch.tensor(pos)
            for i, (fork, start) in enumerate(sees):
                row = attend[b, offset + i]
                if start == 0:
                    row[offset:offset + i + 1] = True
                else:
                    row[offset:offset + fork] = True
                    row[offset + start:offset + i + 1] = True
            offset = end
    return tokens, loss, positions, attend.unsqueeze(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out",
                        default=str(ROOT / "models" / "threadweaver-toy"))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init",
                        help="go on from this checkpoint (new tasks: "
                        "give another --seed)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    out = Path(args.out)
    tokenizer = task_mod.build_tokenizer()
    if not args.init:
        spec = tiny_model.TinyModelSpec(seed=args.seed,
                                        num_layers=args.layers,
                                        weight_scale=1.0)
        tiny_model.build_tiny_model(out, spec, tokenizer)
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(args.init or out,
                                             attn_implementation="sdpa")
    pending: list = []

    def loss_of() -> torch.Tensor:
        tokens, mask, positions, attend = batch(tokenizer, rng, args.rows,
                                                tiny_model.MAX_POSITIONS,
                                                pending)
        logits = model(tokens, attention_mask=attend,
                       position_ids=positions).logits
        return loop.masked_loss_sum(logits, tokens, mask) / mask[:, 1:].sum()

    start = time.monotonic()
    loop.train(model, args.steps, args.lr, loss_of, every=25)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    print(f"saved to {out} in {(time.monotonic() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
