# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Entropy and KL on the common token set
(`rl/experiment/rl_token_scores.py`), on the real promise model: a tree
in the task's form, scored as one packed row, gives at every sampled token
the entropy and KL that a forward of that node's own context gives; the
set survives its compact form; a model against itself has KL 0, a changed
one a positive KL."""

import copy

import pytest
import rl_token_scores as scores
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sequence_hooks import PromiseNode
from sequence_hooks.training_records import training_records
from sequence_hooks_training import capitals_task as task

COUNTRIES = ("France", "Peru")


@pytest.fixture(scope="module")
def tokenizer(real_model):
    return AutoTokenizer.from_pretrained(real_model)


@pytest.fixture(scope="module")
def start(real_model):
    return AutoModelForCausalLM.from_pretrained(real_model,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def changed(start):
    """The starting model with every weight moved by about 1 %."""
    model = copy.deepcopy(start)
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(
                1 + 0.01 *
                torch.randn(param.shape, generator=noise, dtype=param.dtype))
    return model


def a_tree(tokenizer) -> tuple[list[int], PromiseNode, int]:
    """A parallel answer to two countries as the engine reports it: the
    root lists them with a promise each, syncs, gets the children's
    sentences merged and concludes."""

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    promise, sync = ids(task.PROMISE), ids(task.SYNC)
    capitals = [task.CAPITALS[c] for c in COUNTRIES]
    sentences = [
        ids(task.item_sentence(c, a)) for c, a in zip(COUNTRIES, capitals)
    ]
    root, forks = [], []
    for index, country in enumerate(COUNTRIES):
        root += ids(("\n" if index else "") +
                    task.item_heading(index, country))
        root += promise
        forks.append(len(root))
    root += ids(task.LIST_END) + sync
    merged = sentences[0] + ids("\n") + sentences[1]
    span = [len(root), len(merged)]
    root += merged + ids(task.conclusion_of(list(COUNTRIES), capitals))
    children = [{
        "request_id": f"r/{i}",
        "depth": 1,
        "fork_position": fork,
        "text": "",
        "token_ids": sentence,
        "finish_reason": "stop",
        "num_merged_tokens": 0,
        "merged_spans": [],
        "logprobs": None,
        "cumulative_logprob": None,
        "children": [],
    } for i, (fork, sentence) in enumerate(zip(forks, sentences))]
    tree = PromiseNode.from_dict(
        {
            **children[0], "request_id": "r",
            "depth": 0,
            "fork_position": None,
            "token_ids": root,
            "num_merged_tokens": len(merged),
            "merged_spans": [span],
            "children": children
        }, lambda logprob, rank: logprob)
    prompt = tokenizer.apply_chat_template(task.messages_of(
        task.Task(COUNTRIES, True)),
                                           add_generation_prompt=True,
                                           return_dict=False)
    return prompt, tree, tokenizer.convert_tokens_to_ids(task.CHILD)


def own_context_scores(model, reference, records):
    """Entropy and KL at each sampled token, each node's row alone."""
    entropies, kls = [], []
    for record in records:
        context = list(record.context_token_ids)
        ids = torch.tensor([context + list(record.token_ids)])
        sampled = torch.tensor(record.sampled_mask)
        with torch.no_grad():
            own, start = (torch.log_softmax(
                lm(ids).logits[0, len(context) - 1:-1][sampled], -1)
                          for lm in (model, reference))
        entropies.append(-(own.exp() * own).sum(-1))
        kls.append((own.exp() * (own - start)).sum(-1))
    return torch.cat(entropies), torch.cat(kls)


def test_a_packed_tree_scores_each_token_in_its_own_context(
        tokenizer, start, changed):
    prompt, tree, marker = a_tree(tokenizer)
    compact = scores.compact_tree(prompt, tree, [], marker)
    records = training_records(prompt, tree, marker)
    rebuilt = scores.records_of(compact)
    assert [r.context_token_ids
            for r in rebuilt] == [r.context_token_ids for r in records]
    assert [r.sampled_mask
            for r in rebuilt] == [r.sampled_mask for r in records]
    entropy, kl = scores.token_scores(changed, start, compact)
    expected_entropy, expected_kl = own_context_scores(changed, start, records)
    assert len(entropy) == sum(map(sum, (r.sampled_mask for r in records)))
    torch.testing.assert_close(entropy, expected_entropy, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(kl, expected_kl, rtol=1e-4, atol=1e-5)
    # Small (the model is sure of these capitals), but no rounding error.
    assert kl.mean() > 1e-6
    _, itself = scores.token_scores(start, start, compact)
    assert itself.abs().max() == 0
