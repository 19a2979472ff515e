# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The toy models' training loop: AdamW on a one-cycle schedule; the
format toys' whole run from packed rows (`train_packed_toy`); the command
lines of the format toys' training and evaluation scripts."""

import argparse
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch

from sequence_hooks_testkit import tiny_model


def masked_loss_sum(logits: torch.Tensor, tokens: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
    """The summed next-token loss where ``mask`` (per token) is 1.

    Args:
        logits: The model's logits, (rows, width, vocab).
        tokens: The rows' token ids, (rows, width).
        mask: 1 where a token is trained, (rows, width).
    """
    logits = logits[:, :-1]
    return (
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                          tokens[:, 1:].reshape(-1),
                                          reduction="none") *
        mask[:, 1:].reshape(-1).float()).sum()


def train(model, steps: int, lr: float, loss_of: Callable[[], torch.Tensor],
          every: int) -> None:
    """Trains ``model`` for ``steps`` steps, printing the loss every
    ``every`` steps and at the last.

    Args:
        model: The model, its parameters all trained.
        steps: Optimizer steps (the schedule's length).
        lr: The schedule's peak learning rate.
        loss_of: One step's loss, drawing its own batch.
        every: Steps between printed losses.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer,
                                                   max_lr=lr,
                                                   total_steps=steps)
    model.train()
    start = time.monotonic()
    for step in range(steps):
        loss = loss_of()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % every == 0 or step == steps - 1:
            print(
                f"step {step} loss {loss.item():.4f} "
                f"({(time.monotonic() - start) / 60:.1f} min)",
                flush=True)


def pack_rows(tokenizer, rows: int, width: int, pending: list,
              refill: Callable[[], list]) -> tuple:
    """One step's rows: items packed one after the other into ``rows``
    rows of ``width`` tokens, each token seeing only what its item says.

    Args:
        tokenizer: The toy's tokenizer (its padding id).
        rows: Rows a step.
        width: Tokens a row.
        pending: Items that did not fit a row yet (carried to the next
            step).
        refill: More items (one task's), each ``(ids, loss mask,
            positions, sees)``: per token ``(fork, segment start)``, it
            sees its item's tokens ``[0, fork)`` and its own segment from
            ``segment start`` on (``(0, 0)``: every earlier token); or
            ``sees`` is the item's boolean mask itself, a tensor.

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
            while not pending:
                pending += [item for item in refill() if len(item[0]) <= width]
            ids, mask, pos, sees = pending[0]
            if offset + len(ids) > width:
                break
            pending.pop(0)
            end = offset + len(ids)
            tokens[b, offset:end] = torch.tensor(ids)
            loss[b, offset:end] = torch.tensor(mask, dtype=torch.float)
            positions[b, offset:end] = torch.tensor(pos)
            if isinstance(sees, torch.Tensor):
                attend[b, offset:end, offset:end] = sees
                offset = end
                continue
            for i, (fork, start) in enumerate(sees):
                row = attend[b, offset + i]
                if start == 0:
                    row[offset:offset + i + 1] = True
                else:
                    row[offset:offset + fork] = True
                    row[offset + start:offset + i + 1] = True
            offset = end
    return tokens, loss, positions, attend.unsqueeze(1)


def packed_toy_parser(doc: str, out: Path,
                      steps: int) -> argparse.ArgumentParser:
    """The command line of a format toy's training script.

    Args:
        doc: The script's docstring (its first line describes it).
        out: Where the model goes by default.
        steps: Optimizer steps by default.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=str(out))
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init",
                        help="go on from this checkpoint (new tasks: "
                        "give another --seed)")
    return parser


def toy_eval_parser(doc: str, model: Optional[Path], tasks: int,
                    max_tokens: int) -> argparse.ArgumentParser:
    """The command line of a format toy's evaluation script: the model and
    the held-out tasks (drawn from ``--seed``, 1000 by default: training
    draws from 0).

    Args:
        doc: The script's docstring (its first line describes it).
        model: The model's folder by default (None: no default).
        tasks: Held-out tasks by default.
        max_tokens: Each answer's (or call's) token budget by default.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("model",
                        nargs="?",
                        default=None if model is None else str(model))
    parser.add_argument("--tasks", type=int, default=tasks)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    return parser


def train_packed_toy(args: argparse.Namespace, tokenizer, batch: Callable,
                     width: int, max_positions: int, every: int) -> None:
    """Trains a format toy (a tiny Llama from scratch, or from ``--init``)
    on packed rows and saves it with its tokenizer to ``--out``.

    Args:
        args: `packed_toy_parser`'s arguments.
        tokenizer: The toy's tokenizer.
        batch: ``batch(tokenizer, rng, rows, width, pending)``: one step's
            token ids, loss mask, position ids and attention mask
            (``pending`` carries what did not fit to the next step).
        width: Tokens a row.
        max_positions: The model's context window.
        every: Steps between printed losses.
    """
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    out = Path(args.out)
    if not args.init:
        spec = tiny_model.TinyModelSpec(seed=args.seed,
                                        num_layers=args.layers,
                                        weight_scale=1.0,
                                        max_positions=max_positions)
        tiny_model.build_tiny_model(out, spec, tokenizer)
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(args.init or out,
                                             attn_implementation="sdpa")
    pending: list = []

    def loss_of() -> torch.Tensor:
        tokens, mask, positions, attend = batch(tokenizer, rng, args.rows,
                                                width, pending)
        logits = model(tokens, attention_mask=attend,
                       position_ids=positions).logits
        return masked_loss_sum(logits, tokens, mask) / mask[:, 1:].sum()

    start = time.monotonic()
    train(model, args.steps, args.lr, loss_of, every)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    print(f"saved to {out} in {(time.monotonic() - start) / 60:.1f} min")
