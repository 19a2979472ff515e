# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GRPO on promise trees (`vllm_sequence_hooks_rl`) with TRL 1.16 and the
hooked V1 engine colocated in process, on the real promise model (fp32).

One trainer for the module; the tests run in order, the last trains
(packed, the default). Per-node rows (``packed=False``) are tested
alike, and a packed tree's loss and gradients against them.
"""

import logging
import random

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig
from trl.trainer.utils import split_tensor_dict
from vllm_sequence_hooks_rl import TREE_KEY, PromiseTreeGRPOTrainer

from sequence_hooks_training import capitals_task as task

# Largest difference allowed between the engine's logprob of a sampled
# token and the trainer's recomputation (both fp32; vLLM's CPU kernels
# and transformers' eager attention round differently).
LOGPROB_TOLERANCE = 1e-3
GENERATIONS = 2
# Largest relative difference between a packed tree's loss, or a
# parameter's gradient (its norm), and per-node rows' (fp32; attention
# over the same keys summed in another order and with masked ones).
PACKED_TOLERANCE = 1e-4
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
    """`_generate`'s rows (per-node: roots first, then children, then
    fillers; packed: one a tree), their trees and each row's root."""
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


def test_every_node_is_a_row_in_its_own_context(trainer, monkeypatch):
    monkeypatch.setattr(trainer, "packed", False)
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


def test_a_packed_row_is_the_root_then_each_childs_head_and_tokens(trainer):
    tokenizer = trainer.processing_class
    marker = tokenizer.convert_tokens_to_ids(task.CHILD)
    prompts = [task.messages_of(t) for t in tasks(2)]
    rows, trees, roots = rows_of(trainer, prompts)
    assert roots == list(range(len(trees)))
    for (prompt_ids, completion_ids, mask, logprobs), tree in zip(rows, trees):
        assert tree is not None and tree.children, "the model promises"
        expected = list(tree.token_ids)
        expected_mask = [int(sampled) for sampled in tree.sampled_mask]
        for node, _ in child_contexts(tree, prompt_ids, marker):
            if node.token_ids:
                expected += [marker] + list(node.token_ids)
                expected_mask += [0] + [int(s) for s in node.sampled_mask]
        assert completion_ids == expected
        assert mask == expected_mask
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if not m)


def test_trained_tokens_have_the_engines_logprobs_merged_ones_none(
        trainer, monkeypatch):
    # Per-node rows (a packed row's, through TRL's forward: below).
    monkeypatch.setattr(trainer, "packed", False)
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


@pytest.mark.parametrize("packed", [False, True])
def test_each_child_row_gets_its_roots_advantage(trainer, monkeypatch, packed):
    """Per-node rows: each child's row its root's advantage; packed: one
    row a tree. Either way the loss counts the tokens the engine sampled
    and TRL's recomputed logprobs (a packed row's through its tree mask)
    are the engine's."""
    monkeypatch.setattr(trainer, "packed", packed)
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
    assert len(roots) == len(advantages)
    assert (len(advantages) == len(inputs)) == packed
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


def loss_and_gradients(trainer, inputs) -> tuple[float, dict]:
    """A generation batch's loss and every trained parameter's gradient,
    as one optimizer step takes them: TRL's micro-batches, each loss
    normalized by the whole batch's tokens, summed."""
    trainer.model.zero_grad()
    batch = trainer._generate_and_score_completions(inputs)
    loss = 0.0
    for part in split_tensor_dict(batch, trainer.args.steps_per_generation):
        part_loss = trainer._compute_loss(trainer.model, part)
        part_loss.backward()
        loss += part_loss.item()
    gradients = {
        name: param.grad.clone()
        for name, param in trainer.model.named_parameters()
        if param.grad is not None
    }
    trainer.model.zero_grad()
    return loss, gradients


def test_a_packed_tree_has_the_per_node_rows_loss_and_gradients(
        trainer, monkeypatch):
    # Two tasks in one group: the model's samples of one task are often
    # the same tree, whose opposite advantages would cancel every
    # gradient to rounding noise.
    inputs = [{"prompt": task.messages_of(t)} for t in tasks(GENERATIONS)]
    trainer.model.train()
    # As `Trainer.train` sets it: the loss's share of one optimizer step.
    monkeypatch.setattr(trainer,
                        "current_gradient_accumulation_steps",
                        trainer.args.gradient_accumulation_steps,
                        raising=False)
    # One rollout for both layouts: the engine's trees, replayed.
    sampled = trainer.rollout_func([x["prompt"] for x in inputs], trainer)
    assert all(tree is not None and tree.children
               for tree in sampled[TREE_KEY])
    monkeypatch.setattr(
        trainer, "rollout_func", lambda prompts, _: {
            k: list(v)
            for k, v in sampled.items()
        })
    assert trainer.packed
    packed_loss, packed = loss_and_gradients(trainer, inputs)
    monkeypatch.setattr(trainer, "packed", False)
    rows_loss, rows = loss_and_gradients(trainer, inputs)
    assert packed_loss == pytest.approx(rows_loss,
                                        rel=PACKED_TOLERANCE,
                                        abs=1e-7)
    assert packed.keys() == rows.keys() and len(rows) > 200
    for name, gradient in rows.items():
        difference = (packed[name] - gradient).norm()
        assert difference <= PACKED_TOLERANCE * gradient.norm(), name


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
