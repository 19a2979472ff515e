# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GRPO on the real model's own promise trees (TRL + the V1 plugin).

Starts from the fine-tuned SmolLM2 promise model (`./dev setup` prepares
it) and trains it with `vllm_sequence_hooks.rl.PromiseTreeGRPOTrainer` on
parallel capitals tasks over half of the countries its fine-tuning never
saw (on the countries it was fine-tuned on, a task's samples are one and
the same text: no spread, nothing for GRPO to learn); each rollout is a
tree from the hooked V1 engine colocated in this process (vLLM 0.31, the
newest TRL 1.16 accepts), every node of it trained with its root's
advantage; the reward is the share of countries whose capital the final
answer's conclusion gives exactly, plus a small bonus (weight
`BONUS_WEIGHT`) for a shorter critical path.

`--smoke` runs two steps on two tasks and prints one JSON line on stdout
(vLLM's and TRL's logs go to stderr): steps, trees, children, trained
tokens, masked merged tokens, the largest difference between the
trainer's and the engine's logprob of a trained token, whether the
weights changed; it exits 1 if that difference is over
`LOGPROB_TOLERANCE` or the weights did not change. Without it: a run bounded by
`--steps` and `--minutes`, with TRL's progress bar, that writes
`--report` (the run's settings, steps, wall time, seconds per step, peak
memory, TRL's log, and the model card's evaluation of the model before
and after, both forms, with the critical path), the trained checkpoint to
`--out` and the reward curve to `--plot`.

The report is written when training ends, then completed by the
evaluation; `--evaluate-only` reruns the evaluation alone (other
`--eval-seeds`, say) on the checkpoint in `--out`.

Usage (from `./dev rl [--smoke] [...]`, in `.venv-rl`):
    python models/rl_capitals.py [--smoke] [--steps 200] [--minutes 75]
    python models/rl_capitals.py --evaluate-only [--eval-seeds 1000 1001]
"""

import argparse
import ctypes
import functools
import gc
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
# stdout is the report's (one JSON line); logs go to stderr.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402
from vllm_sequence_hooks.rl import PromiseTreeGRPOTrainer  # noqa: E402

import vllm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import capitals_task as task  # noqa: E402
import prepare_base_model as prepare  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EVAL = ROOT / "models" / "research" / "eval_real_model.py"
SPECIAL_KWARGS = dict(sync_token=task.SYNC,
                      promise_token=task.PROMISE,
                      child_role_token=task.CHILD)
# The critical-path bonus's weight next to the capitals' (1): it breaks
# ties between equally right trees, never outweighs a capital.
BONUS_WEIGHT = 0.05
RL_SPLIT_SEED = 29
# Countries per task (a tree of 4 to 7 sequences: the trainer's rows of a
# step fit this machine's memory beside other work).
MIN_ITEMS, MAX_ITEMS = 3, 6
# The smoke check's bound on the trainer's and the engine's logprob of a
# trained token (fp32 on both sides; the RL suite's tolerance).
LOGPROB_TOLERANCE = 1e-3


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
    rewards = []
    for completion, names in zip(completions, countries):
        text = (completion
                if isinstance(completion, str) else completion[-1]["content"])
        right = task.answers_correct(task.Task(tuple(names), True), text)
        rewards.append(sum(right) / len(right))
    return rewards


def critical_path_bonus(completion_ids, promise_tree, max_tokens: int,
                        **_) -> list[float]:
    """How much shorter than the token limit a tree's critical path is
    (in [0, 1]; 1 - critical path / limit): the parallel form's point.

    Args:
        completion_ids: The roots' token ids.
        promise_tree: Per root, its tree (None if it never promised: then
            its path is all its tokens).
        max_tokens: The completion limit.

    Returns:
        One bonus per completion.
    """
    return [
        max(
            0.0, 1 -
            (len(ids) if tree is None else tree.critical_path) / max_tokens)
        for ids, tree in zip(completion_ids, promise_tree)
    ]


def split_held_out() -> tuple[list[str], list[str]]:
    """The held-out countries GRPO trains on, and those it never sees (the
    evaluation's test of transfer), half and half, by a fixed seed.

    Returns:
        The countries trained on, and the others, each sorted.
    """
    countries = list(task.HELD_OUT_COUNTRIES)
    random.Random(RL_SPLIT_SEED).shuffle(countries)
    half = len(countries) // 2
    return sorted(countries[:half]), sorted(countries[half:])


def training_tasks(num_tasks: int, seed: int) -> Dataset:
    """Parallel tasks over the held-out countries GRPO trains on.

    Args:
        num_tasks: How many.
        seed: The draw's seed.

    Returns:
        TRL's prompt dataset: "prompt" (chat messages) and "countries".
    """
    rng = random.Random(seed)
    trained, _ = split_held_out()
    rows = []
    for _ in range(num_tasks):
        t = task.make_task(rng, trained, True,
                           rng.randint(MIN_ITEMS, MAX_ITEMS))
        rows.append({
            "prompt": task.messages_of(t),
            "countries": list(t.countries)
        })
    return Dataset.from_list(rows)


class TimeLimit(transformers.TrainerCallback):
    """Stops training once ``minutes`` have passed (after a whole step)."""

    def __init__(self, minutes: float) -> None:
        self.deadline = time.monotonic() + 60 * minutes

    def on_step_end(self, args, state, control, **kwargs):
        if time.monotonic() > self.deadline:
            control.should_training_stop = True


class MemoryLog(transformers.TrainerCallback):
    """Records this process's resident memory after each step, once the
    step's garbage is collected and glibc has returned its free heap to
    the system (so the figure is what the process holds, not the heap's
    high-water mark)."""

    def __init__(self) -> None:
        self.rss_gib: list[float] = []
        self._libc = ctypes.CDLL("libc.so.6")

    def on_step_end(self, args, state, control, **kwargs):
        gc.collect()
        self._libc.malloc_trim(0)
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        self.rss_gib.append(
            round(pages * os.sysconf("SC_PAGE_SIZE") / 2**30, 2))
        print(f"step {state.global_step}: resident {self.rss_gib[-1]} GiB",
              file=sys.stderr,
              flush=True)


def peak_rss_gib() -> float:
    """This process's peak resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def make_trainer(model_dir: Path, args: argparse.Namespace, dataset: Dataset,
                 out: Path) -> PromiseTreeGRPOTrainer:
    """The trainer over the fine-tuned checkpoint (fp32 on both sides).

    Args:
        model_dir: The checkpoint.
        args: The command line's settings.
        dataset: The prompts (`training_tasks`).
        out: The trainer's output folder.

    Returns:
        The trainer, its engine started.
    """
    config = GRPOConfig(
        output_dir=str(out),
        reward_weights=[1.0, BONUS_WEIGHT],
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.05,
        # One optimizer step per generation batch (prompts x generations
        # trees), taken in micro-batches of one root row's share: a
        # tree's rows (children's long contexts, a 49k vocabulary's
        # logits) do not fit at once in this machine's memory.
        per_device_train_batch_size=1,
        gradient_accumulation_steps=args.prompts * args.generations,
        num_generations=args.generations,
        max_completion_length=args.max_tokens,
        temperature=args.temperature,
        learning_rate=args.learning_rate,
        # Memory: Adafactor's factored moments and recomputed activations
        # keep the trainer, its engine and their copies of the weights in
        # about 4 GiB (AdamW's moments alone are 1 GiB more).
        optim="adafactor",
        gradient_checkpointing=True,
        max_steps=args.steps,
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        disable_tqdm=args.smoke,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    bonus = functools.partial(critical_path_bonus, max_tokens=args.max_tokens)
    bonus.__name__ = critical_path_bonus.__name__
    return PromiseTreeGRPOTrainer(model=model,
                                  processing_class=tokenizer,
                                  reward_funcs=[capitals_reward, bonus],
                                  args=config,
                                  train_dataset=dataset,
                                  special_kwargs=SPECIAL_KWARGS)


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


def evaluate(model: Path, seeds: list[int], tasks: int,
             countries: list[str]) -> dict:
    """The model card's evaluation (`research/eval_real_model.py`, V1
    engine, greedy, fp32) of ``model`` in a process of its own (a second
    engine in this one would compute wrong logits), summed up per form.

    Args:
        model: A checkpoint folder.
        seeds: The held-out task draws.
        tasks: Tasks per draw.
        countries: The held-out countries to draw from.

    Returns:
        Per form: accuracy per country (conclusion, item sentences), share
        of tasks all right, texts cut at the limit, mean critical path,
        and (parallel) share with one child per country.
    """
    out = subprocess.run([
        sys.executable,
        str(EVAL), "--engine", "v1", "--model",
        str(model), "--tasks",
        str(tasks), "--seeds", *map(str, seeds), "--countries", *countries
    ],
                         check=True,
                         capture_output=True,
                         text=True).stdout
    # The report is the last thing printed (after vLLM's log lines, if
    # they go to stdout): from its opening line on.
    lines = out.splitlines()
    start = len(lines) - 1 - lines[::-1].index("{")
    report = json.loads("\n".join(lines[start:]))
    keys = ("accuracy_per_country", "sentence_accuracy_per_country",
            "tasks_all_correct", "tasks_cut_at_token_limit",
            "mean_critical_path", "spawned_one_child_per_country")
    return {
        form: {
            k: report[form][k]
            for k in keys if k in report[form]
        }
        for form in ("parallel", "sequential")
    }


def plot_rewards(log: list[dict], path: Path) -> None:
    """Plots the reward per step (mean over its trees) and its running
    mean.

    Args:
        log: TRL's log history.
        path: The picture to write.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [e["step"] for e in log if "rewards/capitals_reward/mean" in e]
    rewards = [
        e["rewards/capitals_reward/mean"] for e in log
        if "rewards/capitals_reward/mean" in e
    ]
    window = 10
    running = [
        sum(rewards[max(0, i - window + 1):i + 1]) /
        len(rewards[max(0, i - window + 1):i + 1]) for i in range(len(rewards))
    ]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, rewards, ".", alpha=0.5, label="per step")
    ax.plot(steps, running, "-", label=f"running mean ({window} steps)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("capitals right (share)")
    ax.set_ylim(0, 1.05)
    ax.set_title("GRPO on promise trees: SmolLM2-135M promise model")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--minutes", type=float, default=75.0)
    parser.add_argument("--prompts", type=int, default=1)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--learning-rate", type=float, default=2e-5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out",
                        type=Path,
                        default=prepare.cache_dir() / "models" /
                        "smollm2-promise-grpo")
    parser.add_argument("--eval-seeds", type=int, nargs="+", default=[1000])
    parser.add_argument("--eval-tasks", type=int, default=14)
    parser.add_argument("--plot",
                        type=Path,
                        default=ROOT / "docs" / "images" / "rl_reward.png")
    parser.add_argument("--report",
                        type=Path,
                        default=ROOT / "models" / "smollm2-promise" /
                        "grpo_report.json")
    parser.add_argument("--evaluate-only",
                        action="store_true",
                        help="(re)run the evaluation of --out for --report")
    args = parser.parse_args()
    if args.evaluate_only:
        add_evaluation(args, prepare.model_dir())
        return
    if args.smoke:
        args.steps, args.prompts, args.generations = 2, 1, 2
    torch.manual_seed(args.seed)
    model_dir = prepare.model_dir()
    dataset = training_tasks(args.steps * args.prompts, args.seed)
    start = time.monotonic()
    trainer = make_trainer(model_dir, args, dataset, args.out)
    started = time.monotonic() - start
    before = {
        name: param.detach().clone()
        for name, param in trainer.model.named_parameters()
    }
    if args.smoke:
        # Its stdout is the one JSON line: no per-step dicts there.
        trainer.remove_callback(transformers.PrinterCallback)
    memory = MemoryLog()
    trainer.add_callback(memory)
    if not args.smoke:
        trainer.add_callback(TimeLimit(args.minutes))
    trainer.train()
    if args.smoke:
        summary = smoke_summary(trainer, before)
        print(json.dumps(summary))
        sys.exit(0 if summary["weights_changed"] and
                 summary["max_abs_logprob_diff"] <= LOGPROB_TOLERANCE else 1)
    seconds = time.monotonic() - start
    trainer.save_model(str(args.out))
    steps = trainer.state.global_step
    report = {
        "model": model_dir.name,
        "trl": trl.__version__,
        "vllm": vllm.__version__,
        "settings": {
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
        },
        "dtype": "float32 (trainer and engine)",
        "steps": steps,
        "wall_seconds": round(seconds),
        "engine_start_seconds": round(started),
        "seconds_per_step": round((seconds - started) / max(steps, 1), 1),
        "peak_rss_gib": round(peak_rss_gib(), 2),
        "rss_gib_after_each_step": memory.rss_gib,
        "log": trainer.state.log_history,
    }
    del trainer
    gc.collect()
    # Written before the evaluation, which can be rerun on its own.
    args.report.write_text(json.dumps(report, indent=1) + "\n")
    plot_rewards(report["log"], args.plot)
    add_evaluation(args, model_dir)


def add_evaluation(args: argparse.Namespace, model_dir: Path) -> None:
    """Evaluates the checkpoint before and after training on both halves
    of the held-out countries, adds that to the run's report and prints
    the report but its log.

    Args:
        args: The command line's settings (``report``, ``out``,
            ``eval_seeds``, ``eval_tasks``).
        model_dir: The checkpoint trained from.
    """
    report = json.loads(args.report.read_text())
    trained, unseen = split_held_out()
    report["evaluation"] = {
        "seeds": args.eval_seeds,
        "tasks_per_seed": args.eval_tasks,
    }
    for name, countries in (("trained_countries", trained),
                            ("unseen_countries", unseen)):
        report["evaluation"][name] = {
            "countries":
            countries,
            "before":
            evaluate(model_dir, args.eval_seeds, args.eval_tasks, countries),
            "after":
            evaluate(args.out, args.eval_seeds, args.eval_tasks, countries),
        }
    args.report.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "log"}))


if __name__ == "__main__":
    main()
