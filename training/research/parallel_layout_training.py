# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the NPR and Multiverse toys' training scripts share
(train_npr_model.py, train_multiverse_model.py).

As NPR's collator does (``NPRDataCollator.torch_call``), each training
sequence's 4-D mask and position ids come from its own token ids, under
the layout (`sequence_hooks_references.parallel_layout`, with its one
departure: a path's span holds the "\\n" after its close tag). Sequences
are packed into rows, each seeing only itself, its positions its own; the
loss is on the tokens the model samples (not the prompt, not the engine's
forced tokens, not a replaced result).
"""

import argparse
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from sequence_hooks_references.parallel_layout import (LayoutTags,
                                                       ParallelFormat,
                                                       attention_mask,
                                                       forced_mask,
                                                       parse_layout)
from sequence_hooks_testkit import tiny_model
from sequence_hooks_training import loop
from sequence_hooks_training.spell_task import PROMPT, SAMPLED


def encoded(tokenizer, tags: LayoutTags, pieces) -> tuple:
    """A training sequence as the model sees it.

    The pieces are encoded apart (every boundary between them is one
    where encoding is additive: `spell_task`).

    Returns:
        Token ids, loss mask (1 where the model samples and is trained),
        position ids, and the bool mask [L, L] (True: sees).

    Raises:
        AssertionError: If the layout's forced tokens are not the pieces'.
    """
    ids, trained, prompt_len = [], [], 0
    for piece in pieces:
        part = tokenizer.encode(piece.text, add_special_tokens=False)
        ids += part
        trained += [int(piece.role == SAMPLED)] * len(part)
        if piece.role == PROMPT:
            prompt_len = len(ids)
    forced = forced_mask(ids, prompt_len, tags)
    assert not any(f and t for f, t in zip(forced, trained)), ids
    layout = parse_layout(ids, tags)
    sees = attention_mask(layout, additive=False)[0, 0]
    return ids, trained, layout.positions, sees


def batch(tokenizer, rows: int, width: int, pending: list,
          refill: Callable[[], tuple]) -> tuple:
    """One step's rows: sequences packed one after the other, each seeing
    only itself.

    Args:
        tokenizer: The toy's tokenizer (its padding id).
        rows: Rows a step.
        width: Tokens a row.
        pending: Sequences that did not fit a row yet (carried over).
        refill: One more sequence (`encoded`'s tuple).

    Returns:
        Token ids, loss mask, position ids (rows, width) and the additive
        float mask (rows, 1, width, width).
    """
    tokens, loss, positions, sees = loop.pack_rows(tokenizer, rows, width,
                                                   pending, lambda: [refill()])
    additive = torch.zeros(sees.shape).masked_fill(
        ~sees,
        torch.finfo(torch.float).min)
    return tokens, loss, positions, additive


def parser(doc: str, out: Path, steps: int,
           width: int) -> argparse.ArgumentParser:
    """The command line of a toy's training script.

    Args:
        doc: The script's docstring (its first line describes it).
        out: Where the model goes by default.
        steps: Optimizer steps by default.
        width: Tokens a row by default.
    """
    parser = loop.packed_toy_parser(doc, out, steps)
    parser.set_defaults(lr=3e-3)
    parser.add_argument("--width", type=int, default=width)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--replaced", type=float, default=0.2)
    return parser


def train_toy(args: argparse.Namespace, tokenizer, fmt: ParallelFormat,
              task_mod) -> None:
    """Trains a toy (a tiny Llama from scratch, or from ``--init``) and
    saves it with its tokenizer to ``--out``.

    Args:
        args: `parser`'s arguments.
        tokenizer: The toy's tokenizer.
        fmt: Its format.
        task_mod: Its task module (``make_task``, ``pieces``).
    """
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    out = Path(args.out)
    spec = tiny_model.TinyModelSpec(seed=args.seed,
                                    hidden_size=args.hidden,
                                    num_layers=args.layers,
                                    weight_scale=1.0)
    if not args.init:
        tiny_model.build_tiny_model(out, spec, tokenizer)
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(args.init or out,
                                             attn_implementation="sdpa")
    pending: list = []
    tags = fmt.tags(tokenizer)

    def refill() -> tuple:
        task = task_mod.make_task(rng)
        return encoded(tokenizer, tags,
                       task_mod.pieces(task, rng, args.replaced))

    def loss_of() -> torch.Tensor:
        tokens, mask, positions, attend = batch(tokenizer, args.rows,
                                                args.width, pending, refill)
        logits = model(tokens, attention_mask=attend,
                       position_ids=positions).logits
        return loop.masked_loss_sum(logits, tokens, mask) / mask[:, 1:].sum()

    start = time.monotonic()
    loop.train(model, args.steps, args.lr, loss_of, every=50)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    print(f"saved to {out} in {(time.monotonic() - start) / 60:.1f} min",
          flush=True)
