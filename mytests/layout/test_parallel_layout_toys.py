# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The layout's checker and reference decoder
(`sequence_hooks_references.layout_check`) on the toys trained under the
layout (models/npr-toy, models/multiverse-toy), on their held-out prompts
(`prompts.jsonl`):

- the reference decoder's answers pass the checker (no mismatch), its
  forced tokens are the layout's (`forced_mask`), and each path's tokens
  are its greedy tokens in its own context alone (prefix and itself, as a
  parallel engine runs it): decoding in sequence under the mask is
  decoding in parallel;
- a join that concatenates the paths and prefills them gives answers the
  checker rejects on some prompt that forks;
- the toys answer most prompts right, forking where the task has several
  items (Multiverse: nesting where it has a pair).

In the V0 suite (.venv): it needs torch and transformers.
"""

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from sequence_hooks_references.layout_check import (decode_sequential,
                                                    greedy_mismatches)
from sequence_hooks_references.parallel_layout import (MULTIVERSE, NPR,
                                                       forced_mask,
                                                       parallel_layout,
                                                       parse_layout,
                                                       prefill_layout)
from sequence_hooks_training import multiverse_task, npr_task
from sequence_hooks_training import spell_task as spell

MODELS = Path(__file__).resolve().parents[2] / "models"
FORMATS = {"npr": (NPR, npr_task), "multiverse": (MULTIVERSE, multiverse_task)}
# Prompts the tests decode (of each model's prompts.jsonl), and how many
# of them that fork are decoded with a concatenate-and-prefill join too.
PROMPTS, PREFILLED = 6, 3
MAX_TOKENS = 400


@pytest.fixture(scope="module", params=sorted(FORMATS))
def toy(request):
    """A toy: its format, task module, model, tokenizer, prompts."""
    fmt, task_mod = FORMATS[request.param]
    path = MODELS / f"{request.param}-toy"
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    prompts = [
        json.loads(line)
        for line in (path / "prompts.jsonl").read_text().splitlines()
    ]
    return fmt, task_mod, model.eval(), task_mod.build_tokenizer(), prompts


@pytest.fixture(scope="module")
def decoded(toy):
    """The reference decoder's answers to the first prompts (``layout``),
    and with a concatenate-and-prefill join to the first `PREFILLED` of
    them that fork (``prefill``)."""
    fmt, task_mod, model, tokenizer, prompts = toy
    answers: dict[str, list] = {"layout": [], "prefill": []}
    for record in prompts[:PROMPTS]:
        ids = tokenizer.encode(record["prompt"], add_special_tokens=False)
        answers["layout"].append(
            (len(ids), decode_sequential(model, tokenizer, ids, fmt,
                                         MAX_TOKENS)))
        if (record["kind"] != "one word"
                and len(answers["prefill"]) < PREFILLED):
            answers["prefill"].append(
                (len(ids),
                 decode_sequential(model, tokenizer, ids, fmt, MAX_TOKENS,
                                   "prefill")))
    return answers


def test_the_decoders_answers_pass_the_checker(toy, decoded):
    fmt, _, model, tokenizer, _ = toy
    tags = fmt.tags(tokenizer)
    forks = 0
    for prompt_len, out in decoded["layout"]:
        assert out.finish == "eos"
        assert forced_mask(out.ids, prompt_len, tags) == out.forced
        assert greedy_mismatches(model, out.ids, prompt_len, tags) == []
        forks += bool(out.paths)
    assert forks >= PROMPTS // 2


def contexts(ids: list[int], tags) -> list[tuple[list[int], range]]:
    """Per path of ``ids`` that holds no block of its own, what a parallel
    engine's child of it holds: the indices of its context (the prefix it
    forked from, the enclosing paths' tokens up to the fork, its own span)
    and its own span. (A path holding a nested block is no plain causal
    sequence: its inner paths do not see each other; `greedy_mismatches`
    checks it under the mask.)"""
    layout = parse_layout(ids, tags)
    nested = [block.start for block in layout.blocks if block.parent]
    prefix = {}
    out = []
    for block in layout.blocks:
        first = block.paths[0].start
        if block.parent is None:
            before = list(range(first))
        else:
            outer = next(p for p in block.parent.paths
                         if p.start < block.start < p.end)
            before = prefix[id(block.parent)] + list(range(outer.start, first))
        prefix[id(block)] = before
        out += [(before + list(range(p.start, p.end)), range(p.start, p.end))
                for p in block.paths
                if not any(p.start < start < p.end for start in nested)]
    return out


def test_each_path_decodes_alone_as_in_parallel(toy, decoded):
    """The paths' tokens are the greedy ones of a forward over each path's
    own context alone, plain causal at the layout's positions: what an
    engine computes for a child that sees no sibling."""
    fmt, _, model, tokenizer, _ = toy
    tags = fmt.tags(tokenizer)
    checked = 0
    for _, out in decoded["layout"]:
        positions = parse_layout(out.ids, tags).positions
        for kept, span in contexts(out.ids, tags):
            with torch.no_grad():
                logits = model(torch.tensor([[out.ids[k] for k in kept]]),
                               position_ids=torch.tensor(
                                   [[positions[k] for k in kept]])).logits[0]
            offset = len(kept) - len(span)
            # The span's first token is its forced open tag.
            for n, k in enumerate(span):
                if n and not out.forced[k]:
                    assert int(logits[offset + n - 1].argmax()) == out.ids[k]
                    checked += 1
    assert checked > 0


def rejected(model, prompt_len: int, out, tags, layout) -> bool:
    """Whether the checker rejects an answer under ``layout``: a sampled
    token that is not the greedy one, or a sequence the layout refuses."""
    try:
        return bool(
            greedy_mismatches(model,
                              out.ids,
                              prompt_len,
                              tags,
                              out.forced,
                              layout=layout))
    except ValueError:
        return True


def test_a_concatenate_and_prefill_join_is_rejected(toy, decoded):
    """Some answer that forks, decoded with a join that concatenates the
    paths and prefills them, is rejected by the checker; and some answer
    of the layout's is not greedy under plain causal attention at
    positions 0, 1, 2, ..."""
    fmt, _, model, tokenizer, _ = toy
    tags = fmt.tags(tokenizer)
    assert any(
        rejected(model, prompt_len, out, tags, parallel_layout)
        for prompt_len, out in decoded["prefill"] if out.paths)
    assert any(
        rejected(model, prompt_len, out, tags, prefill_layout)
        for prompt_len, out in decoded["layout"] if out.paths)


def test_the_toy_answers_and_forks(toy, decoded):
    fmt, task_mod, _, tokenizer, prompts = toy
    right = 0
    for record, (prompt_len, out) in zip(prompts, decoded["layout"]):
        text = tokenizer.decode(out.ids[prompt_len:],
                                skip_special_tokens=False)
        right += spell.parse_answer(text) == record["answer"].split()
        assert bool(out.paths) == (record["kind"] != "one word")
        if record["kind"] == "nested block":
            assert any(p.depth == 1 for p in out.paths)
    assert right >= PROMPTS - 2
