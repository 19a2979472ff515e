# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GRPO on the real model's own promise trees (TRL + the V1 plugin): the
pre-registered three-arm experiment of docs/rl.md.

Starts from the fine-tuned SmolLM2 promise model (`./dev setup` prepares
it) and trains it with `vllm_sequence_hooks_rl.PromiseTreeGRPOTrainer` on
capitals tasks over the rewarded half of the countries its fine-tuning
never saw (`rl_experiment`), each rollout a tree from the hooked V1
engine colocated in this process (vLLM 0.31, the newest TRL 1.16
accepts). The arms share data, steps and settings:

- A, every node: each child trained in its own context with its root's
  advantage;
- B, roots only: the same trainer with the children's rows left out;
- C, sequential form: the same trainer on the tasks' sequential form.

The reward is the share of capitals the conclusion gets right plus a
critical-path term paid only when all are right
(`rl_experiment.path_bonus`); advantages are not divided by the group's
standard deviation; a KL term (``BETA``) holds the policy near the
starting model.

``--arm X --seed S`` trains arm X with seed S (TRL's and torch's: the
order of the tasks, not the tasks), saves its checkpoint under
``--checkpoints``, records its steps, time and TRL's log in ``--results``
(`models/smollm2-promise/rl_arms.json`, under ``arms.X.seeds.S``), then
evaluates the checkpoint (`rl_eval.py`, in a process of its own) and
records its per-task results there; ``--evaluate before|A|B|C``
(re)evaluates a checkpoint alone. Each write recomputes every figure and
criterion, per seed and across seeds (`rl_seeds`), from the per-task
results and redraws ``--plot``. ``--time-steps N`` trains N steps of an
arm and prints their times, recording nothing.

`--smoke` runs two steps of arm A on one task (two trees a step) and
prints one JSON line on stdout (vLLM's and TRL's logs go to stderr):
steps, trees, children, trained tokens, masked merged tokens, the largest
difference between the trainer's and the engine's logprob of a trained
token, whether the weights changed; it exits 1 if that difference is
over `LOGPROB_TOLERANCE` or the weights did not change.

Usage (from `./dev rl [...]`, in `.venv-rl`):
    python rl/experiment/rl_capitals.py --smoke
    python rl/experiment/rl_capitals.py --evaluate before
    python rl/experiment/rl_capitals.py --arm A --seed 1  # B, C; seeds 0-2
    python rl/experiment/rl_capitals.py --arm B --time-steps 3
"""

import argparse
import ctypes
import functools
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
# stdout is the report's (one JSON line); logs go to stderr.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

import rl_experiment as experiment  # noqa: E402
import rl_seeds  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402
from vllm_sequence_hooks_rl import PromiseTreeGRPOTrainer  # noqa: E402

import vllm  # noqa: E402
from sequence_hooks_training import capitals_task as task  # noqa: E402
from sequence_hooks_training import prepare_base_model as prepare  # noqa: E402

# The experiment's scripts (rl/experiment) and the repository.
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
EVAL = HERE / "rl_eval.py"
SCORES = HERE / "rl_token_scores.py"
SPECIAL_KWARGS = dict(sync_token=task.SYNC,
                      promise_token=task.PROMISE,
                      child_role_token=task.CHILD)
# The pre-registered settings, the same for every arm (docs/rl.md).
STEPS = 36
PROMPTS = 1
GENERATIONS = 4
# Room for the sequential form of 6 countries (about 190 tokens), which
# 200 would cut now and then: a cut answer scores 0 in arm C only.
MAX_TOKENS = 256
LEARNING_RATE = 2e-5
# Constant: a short run's linear decay would leave its last steps next to
# no update.
LR_SCHEDULER = "constant"
TEMPERATURE = 1.0
# The KL term's weight (TRL's default 0 lets the policy drift off the
# countries it is not rewarded on).
BETA = 0.04
# Advantages are the reward minus the group's mean, not divided by its
# standard deviation (which turns the path term's small differences into
# unit-size advantages in a group tied on capitals).
SCALE_REWARDS = "none"
# The training tasks' draw, the same for every arm and seed.
TASKS_SEED = 0
# The starting model's common token set (`rl_token_scores`), in the
# checkpoints' folder: written when it is evaluated, read for each arm.
COMMON_SET = "smollm2-promise-common-set.json"
# The smoke check's bound on the trainer's and the engine's logprob of a
# trained token (fp32 on both sides; the RL suite's tolerance).
LOGPROB_TOLERANCE = 1e-3
# TRL's per-step log entries kept in the results (for the reward curves).
LOG_KEYS = ("step", "reward", "reward_std", "rewards/capitals_reward/mean",
            "rewards/critical_path_bonus/mean", "kl", "entropy",
            "frac_reward_zero_std", "promise_tree/children",
            "promise_tree/trained_tokens", "promise_tree/merged_tokens",
            "sampling/sampling_logp_difference/max",
            "completions/clipped_ratio", "step_time")


def _text(completion) -> str:
    """A completion's text (TRL gives chat messages for chat prompts)."""
    return completion if isinstance(completion,
                                    str) else completion[-1]["content"]


def capitals_reward(completions, countries, **_) -> list[float]:
    """Share of a task's countries whose capital the conclusion gives.

    Args:
        completions: The roots' completions (chat messages or text): the
            parent's text with its children's sentences merged in.
        countries: Per completion, its task's countries (a dataset
            column).

    Returns:
        One reward in [0, 1] per completion.
    """
    return [
        experiment.capitals_share(names, _text(completion))
        for completion, names in zip(completions, countries)
    ]


def critical_path_bonus(completions, completion_ids, countries, promise_tree,
                        max_tokens: int, **_) -> list[float]:
    """The critical-path term, paid only when every capital is right
    (`rl_experiment.path_bonus`).

    Args:
        completions: The roots' completions.
        completion_ids: The roots' token ids.
        countries: Per completion, its task's countries.
        promise_tree: Per root, its tree (None if it never promised: then
            its path is all its tokens).
        max_tokens: The completion limit.

    Returns:
        One term in [0, `rl_experiment.BONUS_WEIGHT`] per completion.
    """
    return [
        experiment.path_bonus(names, _text(completion),
                              len(ids) if tree is None else tree.critical_path,
                              max_tokens) for completion, ids, names, tree in
        zip(completions, completion_ids, countries, promise_tree)
    ]


def training_dataset(arm: str, steps: int) -> Dataset:
    """The arm's prompts: the same tasks in the same order for every arm,
    in the sequential form for C.

    Args:
        arm: "A", "B" or "C".
        steps: Training steps (`PROMPTS` tasks each).

    Returns:
        TRL's prompt dataset: "prompt" (chat messages) and "countries".
    """
    tasks = experiment.training_tasks(steps * PROMPTS, TASKS_SEED, arm != "C")
    return Dataset.from_list([{
        "prompt": task.messages_of(t),
        "countries": list(t.countries)
    } for t in tasks])


class TimeLimit(transformers.TrainerCallback):
    """Stops training once ``minutes`` have passed (after a whole step)."""

    def __init__(self, minutes: float) -> None:
        self.deadline = time.monotonic() + 60 * minutes

    def on_step_end(self, args, state, control, **kwargs):
        if time.monotonic() > self.deadline:
            control.should_training_stop = True


class StepLog(transformers.TrainerCallback):
    """Records, after each step, this process's resident memory (once the
    step's garbage is collected and glibc has returned its free heap to
    the system: what the process holds, not the heap's high-water mark)
    and the CPU seconds the step took (the colocated engine runs in this
    process; on a shared machine the wall time measures the others' load
    too)."""

    def __init__(self) -> None:
        self.rss_gib: list[float] = []
        self.cpu_seconds: list[float] = []
        self._libc = ctypes.CDLL("libc.so.6")
        self._cpu = self._cpu_now()
        self._wall = time.monotonic()

    @staticmethod
    def _cpu_now() -> float:
        times = os.times()
        return times.user + times.system

    def on_step_end(self, args, state, control, **kwargs):
        cpu, wall = self._cpu_now(), time.monotonic()
        self.cpu_seconds.append(round(cpu - self._cpu, 1))
        seconds = round(wall - self._wall, 1)
        self._cpu, self._wall = cpu, wall
        gc.collect()
        self._libc.malloc_trim(0)
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        self.rss_gib.append(
            round(pages * os.sysconf("SC_PAGE_SIZE") / 2**30, 2))
        print(
            f"step {state.global_step}: {seconds} s, "
            f"{self.cpu_seconds[-1]} CPU s, resident {self.rss_gib[-1]} GiB",
            file=sys.stderr,
            flush=True)


def peak_rss_gib() -> float:
    """This process's peak resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def make_trainer(arm: str,
                 steps: int,
                 generations: int,
                 out: Path,
                 seed: int,
                 dataset: Optional[Dataset] = None) -> PromiseTreeGRPOTrainer:
    """The arm's trainer over the fine-tuned checkpoint (fp32 on both
    sides), with the pre-registered settings.

    Args:
        arm: "A", "B" or "C".
        steps: Training steps.
        generations: Trees per task.
        out: The trainer's output folder.
        seed: TRL's seed (its sampler's order of the tasks, the
            micro-batches' shuffle; the engine's seed stays TRL's 0).
        dataset: Prompts taken in their order (default: the arm's
            `training_dataset`, shuffled by the seed).

    Returns:
        The trainer, its engine started.
    """
    config = GRPOConfig(
        output_dir=str(out),
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.05,
        # One optimizer step per generation batch (prompts x generations
        # trees), taken in micro-batches of one root row's share: a
        # tree's rows (children's long contexts, a 49k vocabulary's
        # logits) do not fit at once in this machine's memory.
        per_device_train_batch_size=1,
        gradient_accumulation_steps=PROMPTS * generations,
        num_generations=generations,
        max_completion_length=MAX_TOKENS,
        temperature=TEMPERATURE,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type=LR_SCHEDULER,
        beta=BETA,
        scale_rewards=SCALE_REWARDS,
        # Memory: Adafactor's factored moments and recomputed activations
        # keep the trainer, the reference model, the engine and their
        # copies of the weights in about 4.5 GiB (AdamW's moments alone
        # are 1 GiB more).
        optim="adafactor",
        gradient_checkpointing=True,
        max_steps=steps,
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=seed,
        shuffle_dataset=dataset is None,
        disable_tqdm=True,
    )
    model_dir = prepare.model_dir()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    bonus = functools.partial(critical_path_bonus, max_tokens=MAX_TOKENS)
    bonus.__name__ = critical_path_bonus.__name__
    trainer = PromiseTreeGRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[capitals_reward, bonus],
        args=config,
        train_dataset=training_dataset(arm, steps)
        if dataset is None else dataset,
        special_kwargs=SPECIAL_KWARGS,
        train_children=arm != "B")
    # stdout is for the one JSON line: no per-step dicts there
    # (`StepLog` marks each step on stderr).
    trainer.remove_callback(transformers.PrinterCallback)
    return trainer


def smoke_summary(trainer: PromiseTreeGRPOTrainer,
                  before: dict[str, torch.Tensor]) -> dict:
    """The two-step check's JSON: what the trainer logged, summed.

    Args:
        trainer: The trainer, after its steps.
        before: Its parameters before them.

    Returns:
        steps, trees, children, trained_tokens, masked_merged_tokens,
        max_abs_logprob_diff and weights_changed.
    """
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    changed = any(not torch.equal(before[name], param.detach())
                  for name, param in trainer.model.named_parameters())
    return {
        "steps":
        trainer.state.global_step,
        "trees":
        int(sum(e["promise_tree/trees"] for e in logs)),
        "children":
        int(sum(e["promise_tree/children"] for e in logs)),
        "trained_tokens":
        int(sum(e["promise_tree/trained_tokens"] for e in logs)),
        "masked_merged_tokens":
        int(sum(e["promise_tree/merged_tokens"] for e in logs)),
        "max_abs_logprob_diff":
        max(e["sampling/sampling_logp_difference/max"] for e in logs),
        "weights_changed":
        changed,
    }


def smoke() -> None:
    """Two steps of arm A on one task; prints `smoke_summary` and exits 1
    if the logprobs disagree or the weights did not move."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out:
        trainer = make_trainer("A", 2, 2, Path(out), 0)
        before = {
            name: param.detach().clone()
            for name, param in trainer.model.named_parameters()
        }
        trainer.train()
        summary = smoke_summary(trainer, before)
    print(json.dumps(summary))
    sys.exit(0 if summary["weights_changed"]
             and summary["max_abs_logprob_diff"] <= LOGPROB_TOLERANCE else 1)


def train(arm: str, seed: int, steps: int, minutes: Optional[float],
          checkpoint: Optional[Path]) -> dict:
    """Trains one arm from the fine-tuned checkpoint.

    Args:
        arm: "A", "B" or "C".
        seed: TRL's and torch's seed.
        steps: Training steps.
        minutes: Stops after the step that passes this many minutes
            (None: all ``steps``).
        checkpoint: Where to save the trained model (None: not saved).

    Returns:
        The part's record: ``steps``, ``minutes`` (training, engine start
        excluded), ``settings`` (with memory and engine start) and
        ``log`` (TRL's, `LOG_KEYS` of each step).
    """
    torch.manual_seed(seed)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as out:
        trainer = make_trainer(arm, steps, GENERATIONS, Path(out), seed)
        started = time.monotonic() - start
        steps_log = StepLog()
        trainer.add_callback(steps_log)
        if minutes is not None:
            trainer.add_callback(TimeLimit(minutes))
        trainer.train()
        seconds = time.monotonic() - start - started
        if checkpoint is not None:
            trainer.save_model(str(checkpoint))
    log = [{
        k: e[k]
        for k in LOG_KEYS if k in e
    } for e in trainer.state.log_history if "loss" in e]
    part = {
        "steps": trainer.state.global_step,
        "minutes": round(seconds / 60, 1),
        "settings": {
            "arm": arm,
            "description": experiment.ARMS[arm],
            "prompts_per_step": PROMPTS,
            "generations": GENERATIONS,
            "max_tokens": MAX_TOKENS,
            "learning_rate": LEARNING_RATE,
            "lr_scheduler": LR_SCHEDULER,
            "temperature": TEMPERATURE,
            "beta": BETA,
            "scale_rewards": SCALE_REWARDS,
            "loss_type": trainer.args.loss_type,
            "bonus_weight": experiment.BONUS_WEIGHT,
            "seed": seed,
            "tasks_seed": TASKS_SEED,
            "trl": trl.__version__,
            "vllm": vllm.__version__,
            "dtype": "float32 (trainer and engine)",
            "engine_start_seconds": round(started),
            "peak_rss_gib": round(peak_rss_gib(), 2),
            "rss_gib_after_each_step": steps_log.rss_gib,
            "cpu_seconds_each_step": steps_log.cpu_seconds,
        },
        "log": log,
    }
    del trainer
    gc.collect()
    return part


def evaluate(checkpoint: Path, common_set: Path) -> dict:
    """`rl_eval.py` on ``checkpoint`` in a process of its own (a second
    engine in this one would compute wrong logits), then its entropy and
    KL to the starting model on the common token set
    (`rl_token_scores.py`, another process).

    Args:
        checkpoint: A checkpoint folder.
        common_set: The starting model's common set, written there when
            the checkpoint is the starting model's.

    Returns:
        ``eval_seconds``, ``tasks``, ``per_task`` and
        ``common_set_scores``.
    """
    with tempfile.TemporaryDirectory() as out:
        results, scores = Path(out) / "results.json", Path(out) / "scores"
        subprocess.run([
            sys.executable,
            str(EVAL), "--model",
            str(checkpoint), "--out",
            str(results)
        ],
                       check=True,
                       stdout=sys.stderr)
        evaluated = json.loads(results.read_text())
        if checkpoint == prepare.model_dir():
            common_set.write_text(json.dumps(evaluated["common_set"]) + "\n")
        subprocess.run([
            sys.executable,
            str(SCORES), "--model",
            str(checkpoint), "--reference",
            str(prepare.model_dir()), "--set",
            str(common_set), "--out",
            str(scores)
        ],
                       check=True,
                       stdout=sys.stderr)
        common_scores = json.loads(scores.read_text())
    return {
        "eval_seconds": evaluated["seconds"],
        "tasks": evaluated["tasks"],
        "per_task": evaluated["per_task"],
        "common_set_scores": common_scores,
    }


def record(results_path: Path, plot: Path, name: str, seed: int,
           part: dict) -> dict:
    """Adds a part (``before`` or an arm's seed) to the results,
    recomputes every figure and criterion from the per-task results,
    writes them and redraws the plot.

    Args:
        results_path: The summary file (created if missing).
        plot: The picture of reward curves and accuracies.
        name: "before", "A", "B" or "C".
        seed: The arm's seed (not used for "before": the starting model
            is evaluated once for every seed).
        part: Its `rl_experiment.RAW_KEYS` (``tasks`` too if evaluated,
            which must be the file's).

    Returns:
        The summary written.
    """
    tasks = part.pop("tasks", None) or experiment.evaluation_tasks()
    results = (json.loads(results_path.read_text())
               if results_path.exists() else {
                   "tasks": tasks
               })
    if results["tasks"] != tasks:
        raise ValueError(f"{results_path} holds other evaluation tasks: "
                         "parts must be evaluated on the same tasks")
    commit, dirty = experiment.code_state(ROOT)
    if name == "before":
        # A summary without the starting model holds None there.
        stored = results["before"] = results.get("before") or {}
    else:
        arm = results.setdefault("arms", {}).setdefault(name, {"seeds": {}})
        stored = arm["seeds"].setdefault(str(seed), {})
    stored.update(part, commit=commit, code_dirty=dirty)
    summary = rl_seeds.summarize(results)
    results_path.write_text(experiment.dumps(summary) + "\n")
    rl_seeds.plot(summary, plot)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--smoke", action="store_true")
    action.add_argument("--arm",
                        choices=experiment.ARMS,
                        help="train this arm, then evaluate it")
    action.add_argument("--evaluate",
                        choices=("before", *experiment.ARMS),
                        help="(re)evaluate the starting model or an arm's "
                        "checkpoint")
    parser.add_argument("--seed",
                        type=int,
                        default=0,
                        help="TRL's and torch's seed for --arm (the "
                        "pre-registered runs: 0, 1 and 2)")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--minutes",
                        type=float,
                        help="stop an arm after the step that passes this")
    parser.add_argument("--time-steps",
                        type=int,
                        metavar="N",
                        help="train N steps of --arm, print their times, "
                        "record nothing")
    parser.add_argument("--checkpoints",
                        type=Path,
                        default=prepare.cache_dir() / "models",
                        help="arm X's checkpoint with seed S is "
                        "smollm2-promise-grpo-X-seedS in this folder")
    parser.add_argument("--results",
                        type=Path,
                        default=ROOT / "models" / "smollm2-promise" /
                        "rl_arms.json")
    parser.add_argument("--plot",
                        type=Path,
                        default=ROOT / "docs" / "images" / "rl_arms.png")
    args = parser.parse_args()
    if args.smoke:
        smoke()
    if args.time_steps:
        if not args.arm:
            parser.error("--time-steps needs --arm")
        part = train(args.arm, args.seed, args.time_steps, None, None)
        print(
            json.dumps({
                "arm":
                args.arm,
                "steps":
                part["steps"],
                "engine_start_seconds":
                part["settings"]["engine_start_seconds"],
                "step_seconds": [e["step_time"] for e in part["log"]],
                "cpu_seconds":
                part["settings"]["cpu_seconds_each_step"],
                "children": [e["promise_tree/children"] for e in part["log"]],
                "trained_tokens":
                [e["promise_tree/trained_tokens"] for e in part["log"]],
                "peak_rss_gib":
                part["settings"]["peak_rss_gib"],
            }))
        return
    name = args.arm or args.evaluate
    checkpoint = (prepare.model_dir()
                  if name == "before" else args.checkpoints /
                  f"smollm2-promise-grpo-{name}-seed{args.seed}")
    if args.arm:
        # Recorded before the evaluation, which can be rerun on its own.
        record(
            args.results, args.plot, name, args.seed,
            train(args.arm, args.seed, args.steps, args.minutes, checkpoint))
    summary = record(args.results, args.plot, name, args.seed,
                     evaluate(checkpoint, args.checkpoints / COMMON_SET))
    part = (summary["before"] if name == "before" else
            summary["arms"][name]["seeds"][str(args.seed)])
    print(
        json.dumps({
            name: {
                k: v
                for k, v in part.items() if k in experiment.CELLS
            },
            "criteria": {
                key: value and value.get("met")
                for key, value in (summary["criteria"] or {}).items()
            },
        }))


if __name__ == "__main__":
    main()
