# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The toy models' training loop: AdamW on a one-cycle schedule."""

import time
from collections.abc import Callable

import torch


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
