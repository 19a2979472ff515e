# SPDX-License-Identifier: Apache-2.0
"""The embedded promise/sync model really speaks the protocol.

Held-out "expand" tasks (a seed training never used) through the hooked
engine, greedy: exact-match accuracy of at least 95 %, and every prompt
spawns one child per group (at least 2)."""

import importlib
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "expand"
sys.path.insert(0, str(ROOT / "tools"))
task = importlib.import_module("train_promise_model")

TASKS = 100


@pytest.fixture(scope="module")
def expand_llm():
    from vllm import LLM
    from vllm.config import SpecialKwargs
    return LLM(model=str(MODEL),
               max_model_len=256,
               enforce_eager=True,
               dtype="float32",
               special_kwargs=SpecialKwargs(sync_token="<sync>",
                                            promise_token="<promise>",
                                            child_role_token="<child>"))


def test_held_out_tasks_are_solved_in_parallel(expand_llm):
    from vllm import SamplingParams
    rng = random.Random(1000)
    tasks = [task.make_task(rng) for _ in range(TASKS)]
    outputs = expand_llm.generate([task.prompt_of(t) for t in tasks],
                                  SamplingParams(temperature=0.0,
                                                 max_tokens=128),
                                  use_tqdm=False)
    solved = 0
    for groups, output in zip(tasks, outputs):
        assert output.promise_tree is not None
        assert len(output.promise_tree.children) == len(groups) >= 2
        expected = task.expected_parent_text(groups).split()
        solved += output.outputs[0].text.split() == expected
    assert solved / TASKS >= 0.95
