# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ThreadWeaver's format served in-engine by the V1 plugin
(``special_kwargs={"format": "threadweaver"}``) against ThreadWeaver's own
controller over stock vLLM, on models/threadweaver-toy, each side in a
process of its own: the same answers token for token, and the tree holds
each thread as the controller's branch.

Cases: the toy's held-out prompts with no budget (each call's budget the
window left, as the reference's server gives it), with a response budget
(the controller's ``response_length``, the request's ``max_tokens``
in-engine), sampled, seeded, two samples a prompt, and with stop ids of
the request's own (each call that ends at one is followed by the
controller's next); each offline
(`LLM(..., special_kwargs=)`) and over the OpenAI API (`vllm serve
--special-kwargs`), completions and chat, whole and streamed. The tree
of every sample: its threads as the controller's branches, where each
fork and join fell, and the sampled tokens' logprobs as the controller's
calls give them.
"""

from pathlib import Path

import pytest

from sequence_hooks_testkit.formats.sides import (REFERENCES, TESTKIT, run,
                                                  toy_prompts)
from sequence_hooks_testkit.formats.toy_server import choices
from sequence_hooks_training import threadweaver_task as task_mod

# The shared servers its tests use (conftest's `shared_servers`).
pytestmark = pytest.mark.shares("threadweaver toy")

MODEL = Path(__file__).resolve().parents[2] / "models" / "threadweaver-toy"
TOKENIZER = task_mod.build_tokenizer()
PROMPTS = toy_prompts(MODEL)[:8]
# The cases, each on both sides: the controller's settings and sampling,
# and the engine's budget (None: the window). "no budget" asks for the
# sampled tokens' logprobs, which the tree must carry as the controller's
# calls give them.
CASES = {
    "no budget": ({}, {
        "temperature": 0.0,
        "logprobs": 1
    }, None),
    "budget 60": ({
        "response_length": 60
    }, {
        "temperature": 0.0
    }, 60),
    # Sampled, two samples a prompt: the controller seeds every call of
    # sample i with seed + i, as V1 seeds sample i of an `n > 1` request.
    "n=2 seeded": ({}, {
        "temperature": 1.0,
        "seed": 1234,
        "n": 2
    }, None),
    # The request's own stop ids, which the controller merges into every
    # call's: ":" ends the root's calls in its outlines (each followed by
    # another call), "*" the threads (each closed by the join) and the
    # calls after a join.
    "own stop ids": ({}, {
        "temperature":
        0.0,
        "stop_token_ids":
        TOKENIZER.encode(":*", add_special_tokens=False)
    }, None),
}
# How far a logprob in the tree may be from the controller's call's: the
# same fp32 model computes both, over batches of other shapes (measured
# at most 2.0e-6 over the 2,548 sampled tokens of 20 prompts).
LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> tuple[dict, dict]:
    """Each case on both sides: the controller's rollouts, the engine's
    answers."""
    controller = run(REFERENCES + "run_threadweaver", MODEL, [],
                     [{
                         "name": name,
                         "prompts": PROMPTS,
                         "settings": settings,
                         "sampling": {
                             k: v
                             for k, v in sampling.items() if k != "n"
                         },
                         "n": sampling.get("n", 1)
                     } for name, (settings, sampling, _) in CASES.items()],
                     tmp_path_factory.mktemp("controller"))
    engine = run(TESTKIT + "run_in_engine", MODEL, ["threadweaver"],
                 [{
                     "name": name,
                     "prompts": PROMPTS,
                     "max_tokens": budget,
                     "sampling": sampling
                 } for name, (_, sampling, budget) in CASES.items()],
                 tmp_path_factory.mktemp("engine"))
    return controller, engine


def rollouts(controller: dict, name: str) -> list[dict]:
    """The controller's rollouts of a case, sample after sample."""
    return [one for per in controller[name]["rollouts"] for one in per]


@pytest.mark.parametrize("name", CASES)
def test_the_engine_answers_as_the_controller_token_for_token(answers, name):
    """Greedy, and seeded with two samples a prompt: a seeded join is a
    new call (`Restart`), seeded anew as the controller's next call."""
    controller, engine = answers
    expected = rollouts(controller, name)
    got = engine[name]["answers"]
    for want, have in zip(expected, got, strict=True):
        assert have["token_ids"] == want["token_ids"]
        assert TOKENIZER.decode(have["token_ids"]) == want["text"]
    # The toy forks: the comparison covers joins, not only plain decoding.
    assert sum(len(want["forks"]) for want in expected) > 0


def branches_of(want: dict) -> list[dict]:
    """A rollout's branches, fork after fork."""
    return [b for fork in want["forks"] for b in fork["branches"]]


def assert_tree_as_rollout(tree: dict, want: dict) -> None:
    """A tree's threads are the rollout's branches: label, tokens, finish
    reason; and where each join fell in the root and its length."""
    branches = branches_of(want)
    children = (tree or {}).get("children") or []
    assert [c["label"] for c in children] == [b["label"] for b in branches]
    assert [c["token_ids"]
            for c in children] == [b["token_ids"] for b in branches]
    assert [c["finish_reason"]
            for c in children] == [b["finish_reason"] for b in branches]
    if branches:
        assert [start for start, _ in tree["merged_spans"]
                ] == [fork["position"] for fork in want["forks"]]
        # Each join's headers, threads and suffix, cut where the answer
        # ends (a budget).
        assert [count for _, count in tree["merged_spans"]] == [
            min(
                sum(len(b["joined_ids"])
                    for b in fork["branches"]) + len(fork["suffix_ids"]),
                len(want["token_ids"]) - fork["position"])
            for fork in want["forks"]
        ]


@pytest.mark.parametrize("name", CASES)
def test_the_tree_holds_each_thread_as_the_controllers_branch(answers, name):
    """Every sample's tree, `n > 1` too."""
    controller, engine = answers
    for want, have in zip(rollouts(controller, name),
                          engine[name]["answers"],
                          strict=True):
        assert_tree_as_rollout(have["tree"], want)


def assert_logprobs_close(got: list, want: list) -> None:
    """Null where the other is (a token a join appended), else within
    `LOGPROB_TOLERANCE`. ``got`` in either form of `PromiseNode.to_dict`
    (the API's: `[token id, logprob, rank]` entries, the sampled first)."""
    got = [g[0][1] if isinstance(g, list) else g for g in got]
    assert len(got) == len(want)
    assert [g is None for g in got] == [w is None for w in want]
    assert max((abs(g - w) for g, w in zip(got, want) if w is not None),
               default=0.0) <= LOGPROB_TOLERANCE


def test_the_tree_carries_the_logprobs_of_the_controllers_calls(answers):
    """The root's sampled tokens and every thread's, as the calls that
    sampled them give them; none for the tokens a join appended (what an
    RL trainer reads, node by node)."""
    controller, engine = answers
    threads = 0
    for want, have in zip(rollouts(controller, "no budget"),
                          engine["no budget"]["answers"],
                          strict=True):
        if have["tree"] is None:
            continue
        assert_logprobs_close(have["tree"]["logprobs"], want["logprobs"])
        for child, branch in zip(have["tree"]["children"], branches_of(want)):
            assert_logprobs_close(child["logprobs"], branch["logprobs"])
            threads += 1
    assert threads > 0


@pytest.fixture(scope="module")
def served(shared_servers) -> str:
    """`vllm serve` of the toy with the format, as a user starts it: the
    suite's shared one (`toy_server.start_format_server`, whose chat
    template renders the user's message as it is: the toy has none, so a
    chat prompt is the completions prompt's text)."""
    return shared_servers.get("threadweaver toy").url


def request_body(name: str, prompt: str, chat: bool, stream: bool) -> dict:
    """A user's request of the case: the window left as its budget (the
    case's if it has one), the case's sampling, token ids back."""
    _, sampling, budget = CASES[name]
    prompt_ids = TOKENIZER.encode(prompt, add_special_tokens=False)
    body = {
        "model": str(MODEL),
        "max_tokens": budget or 512 - len(prompt_ids),
        "return_token_ids": True,
        "stream": stream,
        **sampling,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        # Chat's logprobs are a switch and a count.
        if body.pop("logprobs", None):
            body.update(logprobs=True, top_logprobs=0)
    else:
        body["prompt"] = prompt_ids
    return body


def api_tree(answer: dict, index: int, n: int) -> dict:
    """Sample ``index``'s tree in a whole answer's `kv_transfer_params`."""
    params = answer.get("kv_transfer_params") or {}
    if n == 1:
        return params.get("promise_tree")
    return params.get("promise_trees", {}).get(str(index))


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_over_the_api_the_engine_answers_as_the_controller(
        answers, served, name, chat, stream):
    """Every case over the API: the tokens; whole, the tree too (with
    the threads' logprobs when asked)."""
    controller, _ = answers
    n = CASES[name][1].get("n", 1)
    expected = controller[name]["rollouts"]
    for prompt, samples in zip(PROMPTS, expected, strict=True):
        body = request_body(name, prompt, chat, stream)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        got, answer = choices(served, path, body, timeout=300)
        for index, want in enumerate(samples):
            token_ids = [
                t for choice in got if choice["index"] == index
                for t in choice.get("token_ids") or ()
            ]
            assert token_ids == want["token_ids"]
            if stream:
                continue
            tree = api_tree(answer, index, n)
            assert_tree_as_rollout(tree, want)
            for child, branch in zip((tree or {}).get("children") or [],
                                     branches_of(want)):
                if branch["logprobs"] is None:
                    assert child["logprobs"] is None
                else:
                    assert_logprobs_close(child["logprobs"],
                                          branch["logprobs"])
