# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""models/apr-toy's training data, run through APR's controller.

The toy is trained on the generator's sequences (`apr_task.search`): the
parent's calls and each child's, each from the prompt the generator
believes the controller sends. If a prompt differs from what the
controller sends in one character, the model is trained on a context it
never sees when served. Here a model that answers every call with the
generator's own text is driven by the test kit's controller
(`run_apr`): every prompt the controller sends must be one the generator
wrote a sequence for, and the search must end with the generator's final
trace and answer.
"""

import random

import pytest

from sequence_hooks_references.formats.apr_controller import (APRController,
                                                              TextCompletion,
                                                              run_apr)
from sequence_hooks_training import apr_task

# As many as the model card's claim; a few CPU seconds in all.
SEARCHES = 300
# Far above any sequence's length: the data's calls never hit it.
MAX_TOKENS = 4096


class GeneratorBackend:
    """A stock server whose model writes the generator's text: a call's
    completion is the model-written piece that follows exactly its
    prompt in one of the searches' sequences, up to EOS (left out, as
    vLLM leaves it out of the text). Records every prompt it was sent.

    Args:
        searches: The generator's searches.
    """

    def __init__(self, searches: list[apr_task.Search]):
        self.completions: dict[str, str] = {}
        for search in searches:
            for sequence in search.sequences():
                *prompt, written = sequence
                assert written.trained and written.text.endswith(apr_task.EOS)
                self.completions["".join(
                    p.text for p in prompt)] = (written.text.removesuffix(
                        apr_task.EOS))
        self.prompts: list[str] = []

    def generate_text(self, prompts: list[str],
                      params: list[dict]) -> list[TextCompletion]:
        """Each prompt's completion, finished at EOS.

        Args:
            prompts: The controller's prompts, BOS sent as text.
            params: Their sampling parameters (ignored: the text is
                fixed).

        Returns:
            One completion per prompt.
        """
        done = []
        for prompt in prompts:
            self.prompts.append(prompt)
            text = prompt.removeprefix(apr_task.BOS)
            assert text in self.completions, (
                f"the controller sent a prompt the generator wrote no "
                f"sequence for:\n{text!r}")
            done.append(TextCompletion(self.completions[text], "stop", None))
        return done


@pytest.fixture(scope="module")
def searches() -> list[tuple[apr_task.Task, apr_task.Search]]:
    """The generator's searches of ``SEARCHES`` tasks, drawn as training
    draws them."""
    rng = random.Random(0)
    tasks = [apr_task.make_task(rng) for _ in range(SEARCHES)]
    return [(task, apr_task.random_search(task, rng)) for task in tasks]


def test_every_call_the_controller_makes_is_a_training_sequence(searches):
    backend = GeneratorBackend([search for _, search in searches])
    rollouts = run_apr(APRController(apr_task.BOS, MAX_TOKENS), backend,
                       [apr_task.prompt_of(task) for task, _ in searches])
    for (task, search), rollout in zip(searches, rollouts):
        assert rollout.error == ""
        assert rollout.trace == search.text()
        # Each of the search's sequences is one call: none left unused,
        # none made twice.
        assert len(rollout.calls) == len(search.sequences())
        assert len(rollout.rounds) == len(search.rounds)
        solved = search.goal is not None
        assert apr_task.check_solution(apr_task.prompt_of(task),
                                       rollout.answer) is solved
    assert len(backend.prompts) == sum(
        len(search.sequences()) for _, search in searches)


def test_the_searches_cover_joins_with_a_goal_and_without(searches):
    """What the first test covers: calls of sub-searches, children that
    reach the goal and children that do not, solved and unsolved."""
    children = [
        child[-1].text for _, search in searches for round_ in search.rounds
        for child in round_
    ]
    reached = [c for c in children if "equal: Goal Reached" in c]
    assert sum(bool(s.rounds) for _, s in searches) > SEARCHES // 2
    assert 0 < len(reached) < len(children)
    assert 0 < sum(s.goal is not None for _, s in searches) < SEARCHES
