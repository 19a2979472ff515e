# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What tree packing saves (docs/rl.md, issue 46): CPU seconds per
training step of arm A packed, arm A in per-node rows and arm C, side by
side in one run with arm A's settings (`rl_capitals.make_trainer`: fp32
trainer and engine, 4 trees a task, the KL's reference model).

One trainer, one engine: after a warm-up step (not counted), ``--rounds``
rounds of three steps on one training task each, the three kinds in a
rotated order (a Latin square, so none is always first after the
warm-up or the previous kind's garbage): packed and per-node rows on the
task's parallel form, C on its sequential form. CPU seconds are this
process's (the colocated engine runs in it), so others' load on the
machine counts less than in wall time. Writes ``packing`` into
``--results`` (`models/smollm2-promise/rl_arms.json`): per step its kind,
CPU and wall seconds, children and trained tokens; per kind the mean CPU
seconds; ``packed_cpu_over_c`` and ``packed_cpu_over_per_node``.

Usage (in `.venv-rl`):
    python rl/experiment/rl_packing.py --rounds 3
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import rl_capitals as capitals
import rl_experiment as experiment
import transformers
from datasets import Dataset

from sequence_hooks_training import capitals_task as task

KINDS = ("packed", "per_node", "C")


class Alternate(transformers.TrainerCallback):
    """Sets the trainer's rows for each step's kind before it samples."""

    def __init__(self, trainer, kinds: list[str]) -> None:
        self.trainer = trainer
        self.kinds = kinds

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer.packed = self.kinds[state.global_step] != "per_node"


def schedule(rounds: int) -> list[tuple[str, task.Task]]:
    """The steps: a warm-up (C), then each round's three kinds, rotated,
    on the round's task (the experiment's training tasks in turn)."""
    tasks = experiment.training_tasks(rounds + 1, capitals.TASKS_SEED, True)
    steps = [("warm-up", task.Task(tasks[0].countries, False))]
    for number, drawn in enumerate(tasks[1:]):
        for kind in KINDS[number % 3:] + KINDS[:number % 3]:
            steps.append((kind, task.Task(drawn.countries, kind != "C")))
    return steps


def measure(rounds: int) -> dict:
    """Runs the schedule.

    Args:
        rounds: Rounds of the three kinds.

    Returns:
        The ``packing`` record.
    """
    # The code as the run starts (it runs for many minutes).
    commit, dirty = experiment.code_state(capitals.ROOT)
    steps = schedule(rounds)
    dataset = Dataset.from_list([{
        "prompt": task.messages_of(t),
        "countries": list(t.countries)
    } for _, t in steps])
    with tempfile.TemporaryDirectory() as out:
        trainer = capitals.make_trainer("A", len(steps), capitals.GENERATIONS,
                                        Path(out), 0, dataset)
        engine = trainer.vllm_generation.llm.llm_engine.vllm_config
        step_log = capitals.StepLog()
        trainer.add_callback(Alternate(trainer, [kind for kind, _ in steps]))
        trainer.add_callback(step_log)
        start = time.monotonic()
        trainer.train()
        minutes = (time.monotonic() - start) / 60
    logs = [e for e in trainer.state.log_history if "loss" in e]
    rows = [{
        "kind": kind,
        "countries": list(t.countries),
        "cpu_seconds": cpu,
        "wall_seconds": round(entry["step_time"], 1),
        "children": entry["promise_tree/children"],
        "trained_tokens": entry["promise_tree/trained_tokens"],
    } for (kind, t), cpu, entry in zip(steps, step_log.cpu_seconds, logs)]
    mean = {
        kind:
        round(
            statistics.fmean(r["cpu_seconds"] for r in rows
                             if r["kind"] == kind), 1)
        for kind in KINDS
    }
    return {
        "commit": commit,
        "code_dirty": dirty,
        "settings": {
            "arm": "A's (rl_capitals.make_trainer)",
            "rounds": rounds,
            "dtype": "float32 (trainer and engine)",
            "block_size": engine.cache_config.block_size,
            "generations": capitals.GENERATIONS,
            "max_tokens": capitals.MAX_TOKENS,
            "beta": capitals.BETA,
        },
        "minutes": round(minutes, 1),
        "peak_rss_gib": round(capitals.peak_rss_gib(), 2),
        "steps": rows,
        "cpu_seconds_mean": mean,
        "packed_cpu_over_c": round(mean["packed"] / mean["C"], 2),
        "packed_cpu_over_per_node": round(mean["packed"] / mean["per_node"],
                                          2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--results",
                        type=Path,
                        default=capitals.ROOT / "models" / "smollm2-promise" /
                        "rl_arms.json")
    args = parser.parse_args()
    packing = measure(args.rounds)
    results = json.loads(args.results.read_text())
    results["packing"] = packing
    args.results.write_text(experiment.dumps(results) + "\n")
    print(json.dumps({k: v for k, v in packing.items() if k != "steps"}))


if __name__ == "__main__":
    main()
