# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GRPO on promise trees (`vllm_sequence_hooks_rl`) with TRL 1.16 and the
hooked V1 engine colocated in process, on the real promise model (fp32).

One trainer for the module; the tests run in order, the last trains.
"""

import logging
import random

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig
from vllm_sequence_hooks_rl import TREE_KEY, PromiseTreeGRPOTrainer

from sequence_hooks_testkit.training import capitals_task as task

# Largest difference allowed between the engine's logprob of a sampled
# token and the trainer's recomputation (both fp32; vLLM's CPU kernels
# and transformers' eager attention round differently).
LOGPROB_TOLERANCE = 1e-3
GENERATIONS = 2
SPECIAL_KWARGS = dict(sync_token=task.SYNC,
                      promise_token=task.PROMISE,
                      child_role_token=task.CHILD)


def tasks(num: int) -> list[task.Task]:
    rng = random.Random(0)
    return [
        task.make_task(rng, task.TRAIN_COUNTRIES, True, 3) for _ in range(num)
    ]


def rank_reward(completion_ids, **_) -> list[float]:
    """A reward that differs between a prompt's samples whatever they
    wrote (the model's samples of one task are often the same text), so
    that every step has advantages and moves the weights."""
    return [float(i % GENERATIONS) for i in range(len(completion_ids))]


@pytest.fixture(scope="module")
def trainer(real_model, tmp_path_factory):
    dataset = Dataset.from_list([{
        "prompt": task.messages_of(t)
    } for t in tasks(4)])
    config = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("grpo")),
        use_vllm=True,
        vllm_mode="colocate",
        per_device_train_batch_size=1,
        gradient_accumulation_steps=GENERATIONS,
        num_generations=GENERATIONS,
        max_completion_length=160,
        # Large, so that two steps move the logprobs of
        # text the model would not write by far more than
        # the tolerance.
        learning_rate=1e-3,
        optim="adafactor",
        gradient_checkpointing=True,
        max_steps=2,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0)
    return PromiseTreeGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(real_model,
                                                   dtype=torch.float32),
        processing_class=AutoTokenizer.from_pretrained(real_model),
        reward_funcs=rank_reward,
        args=config,
        train_dataset=dataset,
        special_kwargs=SPECIAL_KWARGS)


def model_logprobs(model, context, tokens) -> torch.Tensor:
    """The model's logprob of each of ``tokens`` after ``context``."""
    ids = torch.tensor([list(context) + list(tokens)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(context) - 1:-1].float()
    return torch.log_softmax(logits,
                             -1).gather(1,
                                        torch.tensor(tokens)[:, None])[:, 0]


def rows_of(trainer, prompts):
    """`_generate`'s rows (roots first, then children, then fillers),
    their trees and each row's root."""
    (prompt_ids, completion_ids, masks, _, logprobs, extra, _,
     _) = trainer._generate(prompts)
    rows = list(zip(prompt_ids, completion_ids, masks, logprobs))
    return rows, extra[TREE_KEY], trainer._row_roots.tolist()


def child_contexts(tree, context, marker):
    """Each node below ``tree`` with its context, written out from the
    tree (not from `training_records`)."""
    for child in tree.children:
        child_context = (list(context) +
                         list(tree.token_ids[:child.fork_position]) + [marker])
        yield child, child_context
        yield from child_contexts(child, child_context, marker)


def test_every_node_is_a_row_in_its_own_context(trainer):
    tokenizer = trainer.processing_class
    marker = tokenizer.convert_tokens_to_ids(task.CHILD)
    prompts = [task.messages_of(t) for t in tasks(2)]
    rows, trees, roots = rows_of(trainer, prompts)
    expected = []
    for index, tree in enumerate(trees):
        assert tree is not None and tree.children, "the model promises"
        prompt_ids, completion_ids, mask, _ = rows[index]
        assert completion_ids == list(tree.token_ids)
        assert mask == [int(sampled) for sampled in tree.sampled_mask]
        # An aborted child (its parent ended without syncing it) has no
        # tokens and no row.
        expected += [
            (index, node, context)
            for node, context in child_contexts(tree, prompt_ids, marker)
            if node.token_ids
        ]
    children = [(root, row) for root, row in zip(roots, rows)
                if root >= 0][len(trees):]
    assert len(children) == len(expected)
    for (root, (prompt_ids, completion_ids, mask,
                _)), (index, node, context) in zip(children, expected):
        assert root == index
        assert prompt_ids == context
        assert completion_ids == list(node.token_ids)
        assert mask == [int(sampled) for sampled in node.sampled_mask]


def test_trained_tokens_have_the_engines_logprobs_merged_ones_none(trainer):
    prompts = [task.messages_of(t) for t in tasks(2)]
    rows, _, roots = rows_of(trainer, prompts)
    largest, merged = 0.0, 0
    for (prompt_ids, completion_ids, mask, logprobs), root in zip(rows, roots):
        if root < 0:
            continue
        mask = torch.tensor(mask, dtype=torch.bool)
        engine = torch.tensor(logprobs)
        assert (engine[~mask] == 0.0).all()
        merged += int((~mask).sum())
        recomputed = model_logprobs(trainer.model, prompt_ids, completion_ids)
        largest = max(largest, float((engine - recomputed)[mask].abs().max()))
    assert merged > 0
    assert largest <= LOGPROB_TOLERANCE


def sampled_tokens(tree, root_ids) -> int:
    """Tokens the engine sampled in a tree (every node's own tokens but
    those its merges appended), counted from the tree; ``root_ids``
    when it never promised."""
    if tree is None:
        return len(root_ids)
    return len(tree.token_ids) - tree.num_merged_tokens + sum(
        sampled_tokens(child, ()) for child in tree.children)


def test_each_child_row_gets_its_roots_advantage(trainer, monkeypatch):
    inputs = [{
        "prompt": task.messages_of(t)
    } for t in tasks(1) for _ in range(GENERATIONS)]
    generated = []
    generate = trainer._generate

    def keep_rows(prompts):
        generated.append(generate(prompts))
        return generated[-1]

    monkeypatch.setattr(trainer, "_generate", keep_rows)
    trainer.model.train()
    batch = trainer._generate_and_score_completions(inputs)
    roots = trainer._row_roots
    advantages = batch["advantages"]
    assert len(roots) == len(advantages) > len(inputs)
    assert advantages[:len(inputs)].abs().sum() > 0
    for row, root in enumerate(roots.tolist()):
        expected = 0.0 if root < 0 else advantages[root]
        assert advantages[row] == expected
    # The loss is normalized by exactly the tokens the engine sampled in
    # the trees: children's counted, merged ones and fillers not.
    (_, completion_ids, _, _, _, extra, _, _), = generated
    assert batch["num_items_in_batch"] == sum(
        sampled_tokens(tree, ids)
        for tree, ids in zip(extra[TREE_KEY], completion_ids))
    loss_mask = batch["completion_mask"] * batch["tool_mask"]
    # TRL's own recomputation of every row (children included) against
    # the engine's logprobs, on the tokens it trains.
    difference = (batch["old_per_token_logps"] -
                  batch["sampling_per_token_logps"]).abs()
    assert difference[loss_mask.bool()].max() <= LOGPROB_TOLERANCE


def test_roots_only_leaves_the_children_rows_out(trainer, monkeypatch):
    monkeypatch.setattr(trainer, "train_children", False)
    trainer.model.train()
    prompts = [task.messages_of(t) for t in tasks(2)]
    rows, trees, roots = rows_of(trainer, prompts)
    assert all(tree is not None and tree.children for tree in trees)
    trained = [row for row, root in zip(rows, roots) if root >= 0]
    assert roots[:len(trees)] == list(range(len(trees)))
    assert len(trained) == len(trees)
    for (_, completion_ids, mask, _), tree in zip(trained, trees):
        assert completion_ids == list(tree.token_ids)
        assert mask == [int(sampled) for sampled in tree.sampled_mask]
    # The fillers (if any) train nothing; the children are still counted.
    assert all(row[2] == [0] for row, root in zip(rows, roots) if root < 0)
    logged = trainer._metrics["train"]["promise_tree/children"][-1]
    assert logged == sum(
        sum(1 for node, _ in child_contexts(tree, [], 0) if node.token_ids)
        for tree in trees)


def test_a_small_spread_scaled_to_unit_size_is_warned_about(
        trainer, monkeypatch, caplog):

    def tiny_spread(completions, **_) -> list[float]:
        # Samples tied on the main reward, apart by a path term's size.
        return [0.5 + 0.001 * i for i in range(len(completions))]

    monkeypatch.setattr(trainer, "reward_funcs", [tiny_spread])
    trainer.model.train()
    logger = logging.getLogger("vllm_sequence_hooks_rl.trainer")
    # A WARNING gets through where it is logged (not under "vllm", which
    # TRL's colocated engine sets to ERROR).
    assert logger.isEnabledFor(logging.WARNING)
    monkeypatch.setattr(logger, "handlers", [caplog.handler])
    monkeypatch.setattr(logger, "propagate", False)
    prompts = [task.messages_of(tasks(1)[0])] * GENERATIONS
    assert trainer.args.scale_rewards == "group"
    rewards = trainer._calculate_rewards([{
        "prompt": prompt
    } for prompt in prompts], prompts, ["x"] * GENERATIONS,
                                         [[1]] * GENERATIONS)
    assert rewards[:, 0].tolist() == pytest.approx(
        [0.5 + 0.001 * i for i in range(GENERATIONS)])
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "1 group(s) of rewards spread below" in warnings[0].getMessage()
    assert "scale_rewards='none'" in warnings[0].getMessage()
    # Rewards that differ by a capital raise no warning.
    monkeypatch.setattr(trainer, "reward_funcs", [rank_reward])
    caplog.clear()
    trainer._calculate_rewards([{
        "prompt": prompt
    } for prompt in prompts], prompts, ["x"] * GENERATIONS,
                               [[1]] * GENERATIONS)
    assert not caplog.records


def engine_prompt_logprobs(llm, ids) -> torch.Tensor:
    """The engine's logprob of each token of ``ids`` after the ones
    before it."""
    from vllm.sampling_params import SamplingParams
    output = llm.generate([{
        "prompt_token_ids": ids
    }],
                          SamplingParams(max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False)[0]
    return torch.tensor([
        entry[token].logprob
        for token, entry in zip(ids[1:], output.prompt_logprobs[1:])
    ])


def test_two_steps_change_the_weights_and_the_next_rollout_uses_them(
        trainer, real_model):
    # The weights before training are the checkpoint's (the tests above
    # take no step). Not a deep copy of the trainer's model: its wrapped
    # `forward` still calls the original's.
    before = AutoModelForCausalLM.from_pretrained(real_model,
                                                  dtype=torch.float32).eval()
    trainer.train()
    assert trainer.state.global_step == 2
    old_weights = dict(before.named_parameters())
    assert any(not torch.equal(old_weights[name], param)
               for name, param in trainer.model.named_parameters())
    trainer.model.eval()
    # A known change on top of the two steps (every weight, the embedding
    # the output layer is tied to included, by about 2 %), so that the
    # check does not depend on how far two steps move this model.
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in trainer.model.parameters():
            param.mul_(
                1 + 0.02 *
                torch.randn(param.shape, generator=noise, dtype=param.dtype))
    # The next rollout loads the trainer's weights first; its trained
    # tokens' logprobs are the trainer model's.
    rows, _, roots = rows_of(trainer, [task.messages_of(tasks(1)[0])])
    largest = 0.0
    for (prompt_ids, completion_ids, mask, logprobs), root in zip(rows, roots):
        if root < 0:
            continue
        mask = torch.tensor(mask, dtype=torch.bool)
        new = model_logprobs(trainer.model, prompt_ids, completion_ids)
        largest = max(
            largest,
            float((torch.tensor(logprobs)[mask] - new[mask]).abs().max()))
    assert largest <= LOGPROB_TOLERANCE
    ids = trainer.processing_class("Lima is the capital of France, and "
                                   "Paris of Peru. Hello world")["input_ids"]
    engine = engine_prompt_logprobs(trainer.vllm_generation.llm, ids)
    context, tokens = ids[:1], ids[1:]
    new = model_logprobs(trainer.model, context, tokens)
    old = model_logprobs(before, context, tokens)
    assert (engine - new).abs().max() <= LOGPROB_TOLERANCE
    assert (engine - old).abs().max() > 10 * LOGPROB_TOLERANCE
