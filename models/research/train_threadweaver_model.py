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
    [--out DIR] [--steps 2500] [--batch 16] [--seed 0]
"""

import argparse
import random
import time
from pathlib import Path

import torch

from sequence_hooks_testkit import tiny_model
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


def batch(tokenizer, rng: random.Random, size: int):
    """One step's rows, padded: tokens, loss mask, positions, and the
    boolean attention mask (batch, 1, width, width)."""
    rows = [packed(tokenizer, task_mod.make_task(rng)) for _ in range(size)]
    width = max(len(r[0]) for r in rows)
    tokens = torch.full((size, width), tokenizer.pad_token_id)
    loss = torch.zeros((size, width))
    positions = torch.zeros((size, width), dtype=torch.long)
    # Padding sees itself only, so no row of the mask is empty.
    attend = torch.eye(width, dtype=torch.bool).repeat(size, 1, 1)
    for b, (ids, mask, pos, sees) in enumerate(rows):
        n = len(ids)
        tokens[b, :n] = torch.tensor(ids)
        loss[b, :n] = torch.tensor(mask, dtype=torch.float)
        positions[b, :n] = torch.tensor(pos)
        for i, (fork, start) in enumerate(sees):
            if start == 0:
                attend[b, i, :i + 1] = True
            else:
                attend[b, i, :fork] = True
                attend[b, i, start:i + 1] = True
    return tokens, loss, positions, attend.unsqueeze(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out",
                        default=str(ROOT / "models" / "threadweaver-toy"))
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    out = Path(args.out)
    tokenizer = task_mod.build_tokenizer()
    spec = tiny_model.TinyModelSpec(seed=args.seed,
                                    num_layers=args.layers,
                                    weight_scale=1.0)
    tiny_model.build_tiny_model(out, spec, tokenizer)
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(out, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer,
                                                   max_lr=3e-3,
                                                   total_steps=args.steps)
    model.train()
    start = time.monotonic()
    for step in range(args.steps):
        tokens, weight, positions, attend = batch(tokenizer, rng, args.batch)
        logits = model(tokens, attention_mask=attend,
                       position_ids=positions).logits[:, :-1]
        weight = weight[:, 1:]
        loss = (torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            tokens[:, 1:].reshape(-1),
            reduction="none") * weight.reshape(-1)).sum() / weight.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 250 == 249:
            # A checkpoint to look at while a long run goes on.
            model.save_pretrained(out, safe_serialization=True)
        if step % 50 == 0 or step == args.steps - 1:
            print(
                f"step {step} loss {loss.item():.4f} "
                f"({(time.monotonic() - start) / 60:.1f} min)",
                flush=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    print(f"saved to {out} in {(time.monotonic() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
