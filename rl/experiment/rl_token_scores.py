# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Entropy and KL on a common token set (docs/rl.md, issue 46 item 3).

TRL logs entropy and KL over each arm's own sampled tokens, so arms that
write different texts are measured on different tokens. Here every
checkpoint is scored on the same tokens: the starting model's greedy
trees on the first `COMMON_TASKS` evaluation tasks of each half and form
(`rl_eval.py` keeps them when it evaluates the starting model), every
node's sampled tokens in the context it sampled them in (merged tokens
are scored where they were sampled, not where they were merged). At each
token: the entropy of the checkpoint's next-token distribution and its
KL to the starting model's, KL(checkpoint || start), over the whole
vocabulary (exact, not TRL's sampled estimate), at temperature 1 (the
training's). A tree is one packed row (`vllm_sequence_hooks_rl.packing`):
each token sees what it was generated after, at its position.

Usage (in `.venv-rl`; no engine, transformers only):
    python rl/experiment/rl_token_scores.py --model CHECKPOINT \
        --reference START --set COMMON_SET.json --out SCORES.json
"""

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any, Optional

import rl_experiment as experiment
import torch
import transformers
from vllm_sequence_hooks_rl.packing import (node_row, pack_tree, pad_layouts,
                                            tree_attention)

from sequence_hooks import PromiseNode
from sequence_hooks.training_records import SequenceRecord, training_records

# Tasks per half and form in the common set (the evaluation's first).
COMMON_TASKS = 25


def compact_tree(prompt_ids: list[int], tree: Optional[PromiseNode],
                 tokens: list[int], marker: Optional[int]) -> dict:
    """A tree's nodes as the common set keeps them.

    Args:
        prompt_ids: The prompt's token ids.
        tree: Its promise tree (None if it never promised).
        tokens: The root's tokens (used when it never promised).
        marker: The engine's child role token id.

    Returns:
        ``prompt`` and ``nodes`` (parents first), each with ``parent``
        (an index, None for the root), ``context_length``, ``head`` (its
        context's last token), ``tokens`` and ``sampled`` (0 merged).
    """
    if tree is None:
        nodes = [
            dict(parent=None, tokens=list(tokens), sampled=[1] * len(tokens))
        ]
        return {"prompt": list(prompt_ids), "nodes": nodes}
    records = training_records(prompt_ids, tree, marker)
    index = {record.request_id: i for i, record in enumerate(records)}
    nodes = [{
        "parent": index.get(record.parent_id),
        "context_length": len(record.context_token_ids),
        "head": record.context_token_ids[-1],
        "tokens": list(record.token_ids),
        "sampled": [int(s) for s in record.sampled_mask],
    } for record in records]
    nodes[0] = {k: nodes[0][k] for k in ("parent", "tokens", "sampled")}
    return {"prompt": list(prompt_ids), "nodes": nodes}


def records_of(tree: dict) -> list[SequenceRecord]:
    """`compact_tree`'s nodes as records, each context written out."""
    records, contexts = [], []
    for number, node in enumerate(tree["nodes"]):
        if node["parent"] is None:
            context = tuple(tree["prompt"])
        else:
            parent = tree["nodes"][node["parent"]]
            above = contexts[node["parent"]]
            seen = node["context_length"] - 1 - len(above)
            context = above + tuple(parent["tokens"][:seen]) + (node["head"], )
        contexts.append(context)
        records.append(
            SequenceRecord(
                str(number),
                None if node["parent"] is None else str(node["parent"]),
                context, tuple(node["tokens"]),
                tuple(map(bool, node["sampled"])),
                tuple(0.0 for _ in node["tokens"]), None))
    return records


def token_scores(model: Any, reference: Any,
                 tree: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The entropy of ``model`` and its KL to ``reference`` at each
    sampled token of a tree.

    Args:
        model: The checkpoint (a causal LM, fp32).
        reference: The starting model.
        tree: A `compact_tree`.

    Returns:
        Per sampled token (the tree's packed order), the entropy and the
        KL, in nats.
    """
    records = records_of(tree)
    packed = pack_tree(len(tree["prompt"]), node_row(records[0]), records[1:])
    width = len(tree["prompt"])
    mask, positions = tree_attention(torch.ones(1, width),
                                     pad_layouts([packed.prev]), torch.float32)
    ids = torch.tensor([tree["prompt"] + packed.completion_ids])
    scored = torch.tensor(packed.mask, dtype=torch.bool)
    logprobs = []
    with torch.no_grad():
        for lm in (model, reference):
            logits = lm(input_ids=ids,
                        attention_mask=mask,
                        position_ids=positions).logits[0, width - 1:-1]
            logprobs.append(torch.log_softmax(logits[scored].float(), -1))
    own, start = logprobs
    probs = own.exp()
    return -(probs * own).sum(-1), (probs * (own - start)).sum(-1)


def set_digest(trees: list[dict]) -> str:
    """The common set's sha256 (every part must be scored on one set)."""
    return hashlib.sha256(json.dumps(trees).encode()).hexdigest()


def score(model_dir: Path, reference_dir: Path, common: dict) -> dict:
    """Scores a checkpoint on the common set.

    Args:
        model_dir: The checkpoint.
        reference_dir: The starting model.
        common: ``cells`` (each tree's half and form) and ``trees``.

    Returns:
        ``entropy`` and ``kl`` (means over the set's sampled tokens),
        the same per cell (``cells``), ``tokens`` and ``set_sha256``.
    """
    load = transformers.AutoModelForCausalLM.from_pretrained
    model = load(str(model_dir), dtype=torch.float32).eval()
    reference = load(str(reference_dir), dtype=torch.float32).eval()
    per_cell: dict[str, list] = {cell: [] for cell in experiment.CELLS}
    for cell, tree in zip(common["cells"], common["trees"]):
        per_cell[cell].append(token_scores(model, reference, tree))

    def means(scores: list) -> dict:
        entropy = torch.cat([e for e, _ in scores])
        kl = torch.cat([k for _, k in scores])
        return {
            "entropy": round(float(entropy.mean()), 5),
            "kl": round(float(kl.mean()), 5),
            "tokens": len(entropy),
        }

    every = [s for cell in experiment.CELLS for s in per_cell[cell]]
    return {
        **means(every),
        "cells": {
            cell: means(per_cell[cell])
            for cell in experiment.CELLS
        },
        "set_sha256": set_digest(common["trees"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--reference", type=Path, required=True)
    parser.add_argument("--set", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    common = json.loads(args.set.read_text())
    args.out.write_text(
        json.dumps(score(args.model, args.reference, common)) + "\n")


if __name__ == "__main__":
    main()
