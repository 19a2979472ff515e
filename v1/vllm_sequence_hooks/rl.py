# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GRPO on promise trees with TRL: tree rollouts from the hooked engine.

`tree_rollout` is a TRL `rollout_func`: it runs each prompt through the
hooked V1 engine that the trainer colocates (in process; TRL syncs the
trainer's weights into it before each rollout) and returns each tree's
root in TRL's one-row-per-completion shape, its merged tokens masked
(`env_mask` 0), its children alongside. `PromiseTreeGRPOTrainer` is
`GRPOTrainer` with that engine hooked and every node of a tree trained:

- what is trained: each node's own sampled tokens (hook tokens included:
  `<promise>` and `<sync>` are the policy's actions), in the context it
  sampled them in: the root after the prompt; a child after its parent's
  context, the parent's tokens up to its `<promise>` and the role marker
  (`sequence_hooks.training_records`), not where its text was merged;
- merged tokens are context, never actions: `env_mask` 0 wherever a merge
  appended them (the engine gives them logprob 0.0, never sampled);
- credit: the reward scores the root's final text; every node of a tree
  gets its root's advantage (GRPO's group baseline over the roots of one
  prompt), so a child that wrote the sentence the conclusion used shares
  the conclusion's credit. ``train_children=False`` leaves the children's
  rows out (roots only, their merged tokens still masked): the control
  that tells what training the children adds.

Advantages divided by a reward's standard deviation (TRL's default
``scale_rewards="group"``) turn the differences of a small auxiliary
reward (a bonus for a shorter critical path, say) into unit-size
advantages whenever a group ties on the main reward: a reward function
weighted far below the largest is refused with scaling on, and a group
whose rewards spread less than `SMALL_REWARD_SPREAD` is logged as a
warning at every step it is scaled.

TRL's batch holds one row per prompt; the trainer adds one row per child
after TRL built the roots' rows (`_generate`), so TRL's own code computes
every row's logprobs, reference logprobs, importance-sampling ratio and
masks, and only the advantage is copied from the root
(`_generate_and_score_completions`).
"""

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, Optional

import torch
import trl
import trl.generation.vllm_generation as trl_vllm_generation
from trl import GRPOTrainer
from vllm_sequence_hooks.config import hooked_engine_args, special_kwargs_of
from vllm_sequence_hooks.outputs import promise_tree

from sequence_hooks import PromiseNode, SpecialKwargs
from sequence_hooks.training_records import SequenceRecord, training_records
from vllm.sampling_params import SamplingParams

# The TRL releases this module was tested on: it overrides and reaches
# private members of TRL's GRPO trainer.
SUPPORTED_TRL_VERSIONS = ("1.16.0", )
# Each TRL member this module overrides or relies on: why, and the sha256
# of its source in the supported release (`v1/rl_tests/test_rl_seams.py`
# fails loudly when TRL changes one). Removable when TRL's rollout
# functions can return rows of their own (children) and take engine
# arguments.
TRL_SEAMS = {
    "trl.trainer.grpo_trainer:GRPOTrainer._generate":
    ("overridden: children's rows appended to the roots' rows; relies on "
     "its 8-tuple and on syncing weights only when `_last_loaded_step` "
     "differs from the step",
     "2a27fdf8f5e6f3562508eec3efb9e9dade2e0bf810de5031cdfab429d0a048f2"),
    "trl.trainer.grpo_trainer:GRPOTrainer._calculate_rewards":
    ("overridden: rewards score the roots' rows only; its per-function "
     "rewards (one row per completion) are checked for small spreads "
     "that scaled advantages would magnify",
     "736ae29b083840b5da2638b55ad1258659c644589991fe6a494131354952efef"),
    "trl.trainer.grpo_trainer:GRPOTrainer._generate_and_score_completions":
    ("overridden: children's rows get their root's advantage; relies on it "
     "building every other per-row tensor from `_generate`'s rows and the "
     "advantages from the first len(prompts) rows",
     "1fa48922792dcd5c72da155cfe99db477771a7c61cde15519fe8c86d0cdc0b65"),
    "trl.generation.vllm_generation:VLLMGeneration._init_vllm":
    ("relied on: builds the colocated engine with the module's `LLM` "
     "name, which `hooked_trl_engine` swaps",
     "0e584002e0f6a9c006aaec0e91ecc996ae8c0d3b2ff8491fbf08b484a57d20ce"),
    "trl.generation.vllm_generation:VLLMGeneration._iter_named_params":
    ("called: the trainer's weights as vLLM names them, loaded while the "
     "iterator holds them (PEFT merges the adapters for the iteration only)",
     "baab615d5c7bc3e126cec1430f29213c984b275285b08a269cbfbf0adc2617b8"),
    "trl.generation.vllm_generation:VLLMGeneration.sync_weights":
    ("replaced (never called): it loads tensors one by one, which vLLM's "
     "CPU backend cannot take after start",
     "63d669fb32304ff5e275443abc5e4a2c1e6974ba196d30074bc0f2519f98644c"),
}

# GRPO losses that normalize by the trained tokens of the whole generation
# batch (`num_items_in_batch`): under them a child's row weighs by its
# tokens, as the root's do, and rows that train nothing (the fillers
# `_generate` adds) weigh nothing. Per-row or per-micro-batch means
# ("grpo", "sapo", "bnpo", "dr_grpo", "luspo") would count every child row
# as much as a whole root row and the fillers as rows.
TOKEN_NORMALIZED_LOSSES = ("dapo", "cispo", "vespo")

# With advantages divided by a standard deviation, a reward function
# weighted at most this share of the largest weight is refused: its small
# differences would be scaled to unit size when the others tie.
AUXILIARY_WEIGHT_RATIO = 0.25
# A group whose summed rewards spread less than this (standard deviation,
# but not 0) is warned about when its advantages are scaled: the spread is
# an auxiliary reward's or noise, not the main reward's (a capital of 8
# differing in one of 4 samples spreads 0.0625).
SMALL_REWARD_SPREAD = 0.02

# Not under "vllm": TRL's colocated engine sets that logger to ERROR, which
# would silence the warning below.
logger = logging.getLogger(__name__)

# Extra fields of `tree_rollout`'s output, per root row: its tree's other
# nodes as `SequenceRecord`s (parents first), which the trainer turns into
# rows; its tree (`PromiseNode`), which reward functions get.
CHILDREN_KEY = "promise_children"
TREE_KEY = "promise_tree"


def _special_kwargs(llm: Any) -> SpecialKwargs:
    """The hooked engine's configuration, token strings resolved."""
    return special_kwargs_of(llm.llm_engine.vllm_config).resolve(
        llm.get_tokenizer())


def _prompt_ids(trainer: GRPOTrainer, prompt: Any) -> list[int]:
    """A prompt as token ids: chat-templated if it is a list of messages
    (TRL hands rollout functions the dataset's prompts untouched)."""
    tokenizer = trainer.processing_class
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return tokenizer.apply_chat_template(prompt,
                                         add_generation_prompt=True,
                                         tokenize=True,
                                         return_dict=False,
                                         **trainer.chat_template_kwargs)


def _sampling_params(trainer: GRPOTrainer) -> SamplingParams:
    """The trainer's generation settings, one sample per prompt row (TRL
    repeats each prompt `num_generations` times), sampled tokens'
    logprobs on."""
    return SamplingParams(n=1,
                          temperature=trainer.temperature,
                          top_p=trainer.top_p,
                          top_k=trainer.top_k or -1,
                          min_p=trainer.min_p or 0.0,
                          repetition_penalty=trainer.repetition_penalty,
                          max_tokens=trainer.max_completion_length,
                          logprobs=0)


def _root_record(output) -> SequenceRecord:
    """The record of a request that never promised: its one sequence."""
    completion = output.outputs[0]
    return SequenceRecord(
        output.request_id, None, tuple(output.prompt_token_ids),
        tuple(completion.token_ids), (True, ) * len(completion.token_ids),
        tuple(entry[token].logprob for token, entry in zip(
            completion.token_ids, completion.logprobs)),
        completion.finish_reason)


def run_trees(
    llm: Any, prompts_ids: list[list[int]], params: SamplingParams
) -> list[tuple[Optional[PromiseNode], list[SequenceRecord]]]:
    """Runs prompts through a hooked engine and flattens each tree.

    Args:
        llm: A `vllm.LLM` made with `hooked_engine_args`.
        prompts_ids: The prompts, as token ids.
        params: Sampling parameters with `logprobs=0` (or more) and n = 1.

    Returns:
        Per prompt, its tree (None if it never promised) and its records,
        root first, parents before their children (`training_records`).
    """
    role_marker = _special_kwargs(llm).child_role_token_id
    outputs = llm.generate([{
        "prompt_token_ids": ids
    } for ids in prompts_ids],
                           params,
                           use_tqdm=False)
    trees = []
    for output in outputs:
        tree = promise_tree(output)
        trees.append(
            (tree, [_root_record(output)] if tree is None else
             training_records(output.prompt_token_ids, tree, role_marker)))
    return trees


def _row(record: SequenceRecord) -> tuple[list[int], list[float], list[int]]:
    """A record's completion ids, logprobs (0.0 where merged) and mask."""
    return (list(record.token_ids),
            [0.0 if lp is None else lp for lp in record.logprobs
             ], [int(sampled) for sampled in record.sampled_mask])


def tree_rollout(prompts: list[Any], trainer: GRPOTrainer) -> dict:
    """A TRL `rollout_func`: one promise tree per prompt row.

    Runs on the trainer's colocated engine, which must be hooked
    (`PromiseTreeGRPOTrainer`, or `GRPOTrainer` inside
    `hooked_trl_engine`). With plain `GRPOTrainer` only the roots' rows
    are trained (the children go to the reward functions as
    ``promise_children``), and the weights reach the engine by TRL's own
    sync, which vLLM's CPU backend refuses (`PromiseTreeGRPOTrainer`'s
    does not).

    Args:
        prompts: The trainer's prompt rows (text or chat messages).
        trainer: The trainer, `use_vllm=True`, `vllm_mode="colocate"`.

    Returns:
        ``prompt_ids``, ``completion_ids`` (the root's own tokens and its
        merged ones), ``logprobs`` (0.0 for merged tokens), ``env_mask``
        (1 sampled, 0 merged), ``promise_tree`` (per row, its tree's
        root `PromiseNode`, None if it never promised; reward functions
        get it) and ``promise_children`` (per row, the tree's other nodes
        as `SequenceRecord`s).
    """
    llm = trainer.vllm_generation.llm
    prompts_ids = [_prompt_ids(trainer, prompt) for prompt in prompts]
    trees = run_trees(llm, prompts_ids, _sampling_params(trainer))
    rollout: dict[str, list] = {
        "prompt_ids": prompts_ids,
        "completion_ids": [],
        "logprobs": [],
        "env_mask": [],
        TREE_KEY: [tree for tree, _ in trees],
        CHILDREN_KEY: [],
    }
    for _, records in trees:
        ids, logprobs, mask = _row(records[0])
        rollout["completion_ids"].append(ids)
        rollout["logprobs"].append(logprobs)
        rollout["env_mask"].append(mask)
        rollout[CHILDREN_KEY].append(records[1:])
    return rollout


@contextlib.contextmanager
def hooked_trl_engine(special_kwargs: Any,
                      max_tree_size: Optional[int] = None,
                      dtype: Optional[torch.dtype] = None) -> Iterator[None]:
    """Makes the `LLM` that TRL colocates a hooked one, while in effect.

    Seam (TRL 1.16 `trl.generation.vllm_generation`, which builds its
    colocated engine with `LLM(...)` and takes no engine arguments of the
    caller's): the module's `LLM` name is swapped for a factory that adds
    `hooked_engine_args` to TRL's own arguments and makes room for the
    trees (TRL sizes `max_num_seqs` for one sequence per prompt row).
    Removable when TRL takes extra engine arguments.

    Args:
        special_kwargs: The hooks' configuration (a SpecialKwargs, a dict
            or its JSON).
        max_tree_size: Sequences per tree to make room for; default
            ``1 + max_children_per_request``.
        dtype: The engine's dtype; None leaves vLLM's choice (which
            downcasts an fp32 checkpoint to bf16 on CPU and fp16/bf16 on
            GPUs, so the engine would sample from another model than the
            one trained).

    Yields:
        Nothing: TRL's trainer is built inside the block.
    """
    hooked_args = hooked_engine_args(special_kwargs)
    parsed = SpecialKwargs.parse(special_kwargs)
    tree_size = max_tree_size or 1 + parsed.max_children_per_request

    stock = trl_vllm_generation.LLM

    def hooked_llm(**engine_args: Any) -> Any:
        if engine_args.get("max_num_seqs"):
            engine_args["max_num_seqs"] *= tree_size
        if dtype is not None:
            engine_args["dtype"] = dtype
        return stock(**engine_args, **hooked_args)

    trl_vllm_generation.LLM = hooked_llm
    try:
        yield
    finally:
        trl_vllm_generation.LLM = stock


def _refresh_tied_output_layer(worker: Any) -> None:
    """Re-processes an output layer tied to the input embedding, in a
    worker, after `reload_weights`.

    vLLM's reload processes each layer whose weights it loaded; a tied
    output layer loads none of its own (the embedding's are its), so it
    keeps what it made from the old weights: on CPU the linear kernel's
    packed copy of them (measured: a 5 % change of the embedding left the
    engine's logprobs 0.5 off the trainer's; re-processed, 3e-5). Elsewhere
    this processing does nothing.
    """
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    if head is not None and getattr(model.config, "tie_word_embeddings",
                                    False):
        head.quant_method.process_weights_after_loading(head)


def _scales_advantages(config: trl.GRPOConfig) -> bool:
    """Whether TRL divides the advantages (or a reward) by a standard
    deviation under ``config``."""
    return (config.scale_rewards != "none"
            or config.multi_objective_aggregation == "normalize_then_sum")


def small_spread_groups(rewards: torch.Tensor,
                        num_generations: int,
                        threshold: float = SMALL_REWARD_SPREAD) -> int:
    """Counts the groups whose rewards differ, but by little.

    Args:
        rewards: One summed reward per completion, a prompt's
            ``num_generations`` completions next to each other.
        num_generations: Completions per prompt.
        threshold: The standard deviation below which a spread is small.

    Returns:
        Groups whose standard deviation (TRL's, unbiased) is above 0 and
        below ``threshold``.
    """
    spread = rewards.view(-1, num_generations).std(dim=1)
    return int(((spread > 0) & (spread < threshold)).sum())


def _check_config(model: Any, config: Optional[trl.GRPOConfig]) -> None:
    """Refuses, before TRL builds anything, what `PromiseTreeGRPOTrainer`
    cannot train right.

    Args:
        model: The model passed to the trainer.
        config: Its `GRPOConfig`.

    Raises:
        ValueError: Naming the setting and why.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError("PromiseTreeGRPOTrainer takes the model loaded (a "
                         "PreTrainedModel), not a name: its engine is "
                         "built in the model's dtype, so that it samples "
                         "from the model trained")
    if config is None or not config.use_vllm or (config.vllm_mode
                                                 != "colocate"):
        raise ValueError("PromiseTreeGRPOTrainer generates on a colocated "
                         "hooked engine: pass a GRPOConfig with "
                         "use_vllm=True, vllm_mode='colocate'")
    if config.vllm_enable_sleep_mode:
        raise ValueError("PromiseTreeGRPOTrainer does not support "
                         "vllm_enable_sleep_mode: it loads the weights "
                         "itself and would not wake the engine")
    if config.vllm_tensor_parallel_size > 1:
        raise ValueError("PromiseTreeGRPOTrainer does not support "
                         "vllm_tensor_parallel_size > 1: its rollouts do "
                         "not gather the prompts of a tensor-parallel group")
    if config.loss_type not in TOKEN_NORMALIZED_LOSSES:
        raise ValueError(
            f"PromiseTreeGRPOTrainer needs a loss normalized by the batch's "
            f"trained tokens ({', '.join(TOKEN_NORMALIZED_LOSSES)}), not "
            f"{config.loss_type!r}: a per-row mean would weigh each child's "
            "row as much as a whole root's")
    # A penalty weighs by its size; a weight of 0 turns its function off.
    sizes = [abs(w) for w in config.reward_weights or [] if w]
    if (_scales_advantages(config) and len(sizes) > 1
            and min(sizes) <= AUXILIARY_WEIGHT_RATIO * max(sizes)):
        raise ValueError(
            f"PromiseTreeGRPOTrainer refuses reward_weights "
            f"{config.reward_weights} with "
            f"scale_rewards={config.scale_rewards!r} (multi_objective_"
            f"aggregation={config.multi_objective_aggregation!r}): "
            "advantages divided by a standard deviation turn the small "
            "weighted reward's differences into unit-size advantages "
            "whenever a group ties on the others; pass "
            "scale_rewards='none' with 'sum_then_normalize'")


class PromiseTreeGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` that trains every node of its promise-tree rollouts.

    Its colocated engine is hooked (`hooked_trl_engine`) and its rollouts
    are `tree_rollout`'s. Each child becomes a row of its own after the
    roots' rows, in its own context, with its root's advantage.

    Args:
        special_kwargs: The hooks' configuration.
        train_children: Whether children's rows are trained; False
            trains the roots' rows only (the trees are sampled the same).
        *args: `GRPOTrainer`'s; its ``model`` loaded (not a name), its
            ``args`` with ``use_vllm=True``, ``vllm_mode="colocate"``, a
            loss in `TOKEN_NORMALIZED_LOSSES`, no sleep mode, no tensor
            parallelism, and no reward weighted at most
            `AUXILIARY_WEIGHT_RATIO` of the largest under advantages
            scaled by a standard deviation (`_check_config`).
        **kwargs: `GRPOTrainer`'s; ``rollout_func`` defaults to
            `tree_rollout`.
    """

    def __init__(self,
                 *args: Any,
                 special_kwargs: Any,
                 train_children: bool = True,
                 **kwargs: Any) -> None:
        if trl.__version__ not in SUPPORTED_TRL_VERSIONS:
            raise RuntimeError(
                f"vllm_sequence_hooks.rl supports TRL "
                f"{', '.join(SUPPORTED_TRL_VERSIONS)}, not the installed "
                f"{trl.__version__}: it overrides private members of "
                "GRPOTrainer (TRL_SEAMS)")
        model = kwargs.get("model", args[0] if args else None)
        _check_config(model, kwargs.get("args"))
        kwargs.setdefault("rollout_func", tree_rollout)
        self.train_children = train_children
        # Per generation batch: for each row, the root row it belongs to.
        self._row_roots: Optional[torch.Tensor] = None
        # The engine samples from the model being trained, in its dtype.
        with hooked_trl_engine(special_kwargs, dtype=model.dtype):
            super().__init__(*args, **kwargs)

    def _sync_engine_weights(self) -> None:
        """Loads the trainer's weights into the colocated engine.

        TRL's own sync loads each tensor with the model's `load_weights`,
        which vLLM's CPU backend cannot take after start (it repacks
        linear weights for its GEMM kernels and drops the parameters'
        loaders); vLLM's `reload_weights` reloads them all and repacks
        again, on every platform.
        """
        llm = self.vllm_generation.llm
        # TRL's iterator itself, consumed in this process (the colocated
        # engine's executor runs here): a tensor it yields is valid only
        # while it holds it (PEFT merges the adapters for the iteration,
        # ZeRO-3 and FSDP gather one parameter at a time), and the model
        # is not copied.
        llm.collective_rpc("reload_weights",
                           kwargs={
                               "weights_iterator":
                               self.vllm_generation._iter_named_params()
                           })
        llm.collective_rpc(_refresh_tied_output_layer)
        if not llm.reset_prefix_cache():
            raise RuntimeError("the engine kept its prefix cache after a "
                               "weight sync: its cached KV is the old "
                               "weights'")

    def _generate(self, prompts: list):
        if self.state.global_step != self._last_loaded_step:
            self._sync_engine_weights()
            # TRL's `_generate` syncs only when this differs.
            self._last_loaded_step = self.state.global_step
        (prompt_ids, completion_ids, tool_mask, completions, logprobs,
         extra_fields, images, tool_images) = super()._generate(prompts)
        children = extra_fields.pop(CHILDREN_KEY, [[]] * len(prompt_ids))
        roots = list(range(len(prompt_ids)))
        if tool_mask is None:
            tool_mask = [[1] * len(ids) for ids in completion_ids]
        # A child aborted (its parent ended without syncing it) has no
        # tokens recorded: nothing of it to train.
        children = [[r for r in records if r.token_ids]
                    for records in children]
        for root, records in enumerate(children):
            for record in records if self.train_children else ():
                ids, record_logprobs, mask = _row(record)
                prompt_ids.append(list(record.context_token_ids))
                completion_ids.append(ids)
                logprobs.append(record_logprobs)
                tool_mask.append(mask)
                roots.append(root)
        # TRL splits a generation batch into `steps_per_generation` equal
        # parts and drops a remainder: pad with rows that train nothing.
        while len(roots) % self.args.steps_per_generation:
            prompt_ids.append(prompt_ids[0])
            completion_ids.append(completion_ids[0][:1])
            logprobs.append(logprobs[0][:1])
            tool_mask.append([0])
            roots.append(-1)
        self._row_roots = torch.tensor(roots)
        self._log_trees(children, tool_mask, roots)
        return (prompt_ids, completion_ids, tool_mask, completions, logprobs,
                extra_fields, images, tool_images)

    def _log_trees(self, children: list[list[SequenceRecord]],
                   masks: list[list[int]], roots: list[int]) -> None:
        """Logs a generation batch's trees with TRL's metrics: trees,
        children (trained or not), trained tokens and merged tokens
        masked out in the rows trained."""
        metrics = self._metrics["train" if self.model.training else "eval"]
        real = [mask for mask, root in zip(masks, roots) if root >= 0]
        metrics["promise_tree/trees"].append(len(children))
        metrics["promise_tree/children"].append(sum(map(len, children)))
        metrics["promise_tree/trained_tokens"].append(sum(map(sum, real)))
        metrics["promise_tree/merged_tokens"].append(
            sum(len(mask) - sum(mask) for mask in real))

    def _calculate_rewards(self, inputs, prompts, completions,
                           completion_ids_list):
        # Rewards score the roots (the rows TRL made, one per prompt).
        rewards = super()._calculate_rewards(
            inputs, prompts, completions, completion_ids_list[:len(prompts)])
        generations = (self.num_generations
                       if self.model.training else self.num_generations_eval)
        if _scales_advantages(self.args) and generations > 1:
            summed = (rewards *
                      self.reward_weights.to(rewards.device)).nansum(dim=1)
            small = small_spread_groups(summed, generations)
            if small:
                logger.warning(
                    "step %d: %d group(s) of rewards spread below %s and "
                    "their advantages are divided by that spread (scale_"
                    "rewards=%r): unit-size advantages from a small "
                    "auxiliary reward or noise; use scale_rewards='none'",
                    self.state.global_step, small, SMALL_REWARD_SPREAD,
                    self.args.scale_rewards)
        return rewards

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        roots = self._row_roots.to(output["advantages"].device)
        advantages = output["advantages"][roots.clamp(min=0)]
        output["advantages"] = torch.where(roots >= 0, advantages,
                                           torch.zeros_like(advantages))
        return output
