# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Measures the "expand" model through the hooked engine (greedy).

Held-out tasks come from a seed the training never used. A task counts as
solved when the parent's final text equals the expected one word for word
(merged children, then the answers) and it spawned one child per group.

Then, on other held-out tasks, it checks that the parent's conclusion comes
from the merged results rather than from its prompt: every child is made
to answer a word its group does not start with (`ForceChildAnswer`), and
the conclusion counts as following when it lists that word for every
child. Prints a JSON report.
"""

import os
import random

import torch

from sequence_hooks_training import expand_task as task


class ForceChildAnswer:
    """Logits processor: a child (its output holds the role marker) that
    has just written the answer marker must answer ``answer_id``."""

    def __init__(self, marker_id: int, child_id: int, answer_id: int):
        # The token before an answer ("so").
        self.marker_id = marker_id
        # The role marker every child's output holds.
        self.child_id = child_id
        # The only answer allowed.
        self.answer_id = answer_id

    def __call__(self, output_ids, logits):
        if (output_ids and output_ids[-1] == self.marker_id
                and self.child_id in output_ids):
            forced = torch.full_like(logits, -float("inf"))
            forced[self.answer_id] = 0.0
            return forced
        return logits


def load(model: str):
    """The model on the hooked V0 engine, fp32, as the card measures it.

    Args:
        model: The model's folder.

    Returns:
        An `LLM` with the expand task's special tokens.
    """
    os.environ.setdefault("VLLM_USE_V1", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    from vllm.config import SpecialKwargs
    return LLM(model=model,
               max_model_len=256,
               enforce_eager=True,
               dtype="float32",
               special_kwargs=SpecialKwargs(sync_token="<sync>",
                                            promise_token="<promise>",
                                            child_role_token="<child>"))


def solve(llm, num_tasks: int, seed: int) -> dict:
    """Exact match and spawning on ``num_tasks`` tasks from ``seed``.

    Args:
        llm: The model, from `load`.
        num_tasks: Tasks to run.
        seed: Seed of the tasks.

    Returns:
        The fraction solved, the fraction that spawned one child per group
        (at least 2), and up to three failures.
    """
    from vllm import SamplingParams
    rng = random.Random(seed)
    tasks = [task.make_task(rng) for _ in range(num_tasks)]
    outputs = llm.generate([task.prompt_of(t) for t in tasks],
                           SamplingParams(temperature=0.0, max_tokens=128),
                           use_tqdm=False)
    solved = spawned_enough = 0
    failures = []
    for groups, output in zip(tasks, outputs):
        text = output.outputs[0].text.split()
        children = (len(output.promise_tree.children)
                    if output.promise_tree else 0)
        spawned_enough += children >= 2 and children == len(groups)
        expected = task.expected_parent_text(groups)
        if text == expected.split() and children == len(groups):
            solved += 1
        elif len(failures) < 3:
            failures.append({
                "prompt": task.prompt_of(groups),
                "got": " ".join(text),
                "expected": expected
            })
    return {
        "exact_match": solved / num_tasks,
        "spawned_one_child_per_group": spawned_enough / num_tasks,
        "failures": failures,
    }


def follow_forced_answers(llm, num_tasks: int, seed: int) -> float:
    """How often the conclusion follows answers the children were forced
    to give.

    Args:
        llm: The model, from `load`.
        num_tasks: Tasks to run.
        seed: Seed of the tasks and of the forced answers.

    Returns:
        The fraction of tasks whose conclusion lists the forced answer for
        every child (tasks whose children did not all give it count as not
        following).
    """
    from vllm import SamplingParams
    tokenizer = llm.get_tokenizer()
    marker_id, child_id = tokenizer.convert_tokens_to_ids(
        [task.MARKER, "<child>"])
    rng = random.Random(seed)
    cases = []
    for _ in range(num_tasks):
        groups = task.make_task(rng)
        # An answer no child would give: the prompt cannot tell it.
        answer = rng.choice(
            [w for w in task.CONTENT if w not in {g[0]
                                                  for g in groups}])
        cases.append((groups, answer))
    outputs = llm.generate([task.prompt_of(groups) for groups, _ in cases], [
        SamplingParams(temperature=0.0,
                       max_tokens=128,
                       logits_processors=[
                           ForceChildAnswer(
                               marker_id, child_id,
                               tokenizer.convert_tokens_to_ids(answer))
                       ]) for _, answer in cases
    ],
                           use_tqdm=False)
    followed = 0
    for (groups, answer), output in zip(cases, outputs):
        children = output.promise_tree.children
        merged = " ".join(c.text.strip() for c in children).split()
        text = output.outputs[0].text.split()
        followed += ([c.text.split()[-1]
                      for c in children] == [answer] * len(groups)
                     and text == merged + [answer] * len(groups))
    return followed / num_tasks
