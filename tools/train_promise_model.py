# SPDX-License-Identifier: Apache-2.0
"""Trains a tiny Llama that speaks promise/sync on a parallel task.

The task ("expand"): the prompt lists k groups of 5 words, separated by
"then". The parent writes one `<promise>` per group, then `<sync>`; the
engine merges the children's texts; the parent then writes the number of
groups and ends. The child of the i-th promise (it starts with `<child>`)
writes every word of group i four times (20 words) and ends. Every answer
is checkable by a program, and children write enough tokens for
parallelism to matter.

Usage: .venv/bin/python tools/train_promise_model.py [--out DIR]
    [--steps 2500] [--seed 0]
"""

import argparse
import importlib
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "mytests"))

# The tiny model kit lives with the tests.
tiny_model = importlib.import_module("tiny_model")
CHILD, PROMISE, SYNC = tiny_model.CHILD, tiny_model.PROMISE, tiny_model.SYNC

SEPARATOR = "then"
NUMBERS = {2: "two", 3: "three", 4: "four"}
GROUP_WORDS = 5
REPEAT = 4
CONTENT = [
    "cat", "dog", "bird", "fish", "tree", "sun", "moon", "star", "red", "blue",
    "green", "big", "small", "old", "new", "yes", "no", "up", "down", "left",
    "right"
]


def make_task(rng: random.Random) -> list[list[str]]:
    k = rng.choice(sorted(NUMBERS))
    return [rng.choices(CONTENT, k=GROUP_WORDS) for _ in range(k)]


def prompt_of(groups: list[list[str]]) -> str:
    return f" {SEPARATOR} ".join(" ".join(g) for g in groups)


def child_answer(group: list[str]) -> str:
    return " ".join(w for w in group for _ in range(REPEAT))


def expected_parent_text(groups: list[list[str]]) -> str:
    """The parent's text as the hooked engine produces it (words only)."""
    merged = " ".join(child_answer(g) for g in groups)
    return f"{merged} {NUMBERS[len(groups)]}"


def examples(tokenizer, groups):
    """(token ids, loss mask) for the parent and each child."""
    ids = tokenizer.convert_tokens_to_ids
    prompt = tokenizer.encode(prompt_of(groups), add_special_tokens=False)
    k = len(groups)
    merged = tokenizer.encode("\n".join(child_answer(g) for g in groups),
                              add_special_tokens=False)
    answer = ids(NUMBERS[k])
    eos = tokenizer.eos_token_id
    parent_out = [ids(PROMISE)] * k + [ids(SYNC)]
    tokens = prompt + parent_out + merged + [answer, eos]
    # Merged tokens are given by the engine, not predicted.
    mask = ([0] * len(prompt) + [1] * len(parent_out) + [0] * len(merged) +
            [1, 1])
    yield tokens, mask
    for i, group in enumerate(groups):
        head = prompt + [ids(PROMISE)] * (i + 1) + [ids(CHILD)]
        body = tokenizer.encode(child_answer(group),
                                add_special_tokens=False) + [eos]
        yield head + body, [0] * len(head) + [1] * len(body)


def batches(tokenizer, rng, size):
    """One training step's rows, as (tokens, loss mask) tensors.

    Parents' rows (which hold the merged text) are about twice as long as
    children's; padding each kind to its own width saves a third of the
    compute.
    """
    rows = sorted((row for _ in range(size)
                   for row in examples(tokenizer, make_task(rng))),
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
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer,
                                                   max_lr=3e-3,
                                                   total_steps=args.steps)
    model.train()
    start = time.monotonic()
    for step in range(args.steps):
        losses, weights = [], 0.0
        for tokens, mask in batches(tokenizer, rng, 16):
            logits = model(tokens).logits[:, :-1]
            target, weight = tokens[:, 1:], mask[:, 1:].float()
            losses.append((torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                target.reshape(-1),
                reduction="none") * weight.reshape(-1)).sum())
            weights += weight.sum()
        loss = sum(losses) / weights
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 200 == 0 or step == args.steps - 1:
            print(
                f"step {step} loss {loss.item():.4f} "
                f"({(time.monotonic() - start) / 60:.1f} min)",
                flush=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    print(f"saved to {out}")


if __name__ == "__main__":
    main()
