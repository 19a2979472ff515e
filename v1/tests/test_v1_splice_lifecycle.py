# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NPR's and Multiverse's splice joins on the real V1 scheduler, model-free,
with and without async scheduling: the lifecycle of a block (a goal's
closing tag forks one path per label, the paths close, the parked parent
adopts the first path's blocks and gets the later paths' tokens copied),
its ends otherwise (an EOS, a budget), Multiverse's nesting, `n > 1`, an
abort from outside at each point of it and KV pressure. After each, the
scheduler holds nothing: no request, member, parked parent, position map
or KV block.

A scripted greedy model writes each node's script (`splice_toy.scripted`):
the root its goal, each path its word spelled and closed, the root after
the join the paths' results and an answer. The model runners' side of a
splice (positions, token copies) is not run here: the scheduler's
`SpliceStep`s, which carry it, are read instead.
"""

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from vllm_sequence_hooks.scheduler import SequenceHookScheduler
from vllm_sequence_hooks.splice_step import STEP_ATTRIBUTE, deltas

from sequence_hooks_testkit.formats.splice_toy import (PAD, TOYS, Node,
                                                       SpliceToy, scripted)
from sequence_hooks_testkit.v1_batch_queue import (BatchQueueDriver,
                                                   fork_stages, make_request,
                                                   make_scheduler, own_tokens)

FORMATS = sorted(TOYS)
ASYNC = pytest.mark.parametrize("async_scheduling", [False, True],
                                ids=["sync", "async"])
PROMPT = "ox banana\n"
# One path per word, in label order; "banana"'s runs on after "ox"'s.
WORDS = ["ox", "banana", "cat", "sun", "tree"]
# `make_scheduler`'s KV block size.
BLOCK_SIZE = 16
# Steps the driver may take without scheduling anything before it is
# stuck (past its batches in flight, nothing can change).
STALL = 4


def spelled(toy: SpliceToy, word: str) -> str:
    """A path's text after its header: the word spelled, its last letter,
    the path's closing tag."""
    return f" {word} = {' '.join(word)} so {word[-1]}\n{toy.path_close}"


def after_text(toy: SpliceToy, results: list[tuple[str, str]],
               answer: str) -> str:
    """What a member writes after its join's closing tokens."""
    listed = " ".join(f"{label}: {result}" for label, result in results)
    return f"{listed}\n{toy.after_close}\n{toy.block_close}{answer}"


def path(toy: SpliceToy, text: str) -> Node:
    """A path that writes ``text`` (closed), then `PAD` (dropped)."""
    return Node(toy.ids(text) + toy.ids(PAD), [])


def joined(toy: SpliceToy, paths: list[tuple[str, str]]) -> str:
    """A block's paths as the join places them after the goal: the
    newline, then each path's header, text and newline."""
    return "\n" + "".join(f"{toy.header(label)}{text}\n"
                          for label, text in paths)


@dataclass(frozen=True)
class Answer:
    """A scripted answer: each node's script and the answer's text as the
    engine ends it (before its EOS)."""

    nodes: dict[str, Node]
    text: str
    # Each top-level path's label and text.
    paths: list[tuple[str, str]]


def block(toy: SpliceToy, words: list[str]) -> Answer:
    """One block with a path per word, then the results and an answer."""
    labels = [str(i + 1) for i in range(len(words))]
    paths = [(label, spelled(toy, word)) for label, word in zip(labels, words)]
    goal = toy.goal([f"{label}: {word}" for label, word in zip(labels, words)])
    after = after_text(toy, [(label, word[-1])
                             for label, word in zip(labels, words)],
                       "answer " + " ".join(word[-1] for word in words))
    nodes = {"": Node(toy.ids(goal), toy.ids(after) + [toy.eos])}
    nodes.update((label, path(toy, text)) for label, text in paths)
    return Answer(nodes,
                  goal + joined(toy, paths) + f"{toy.after_open}\n" + after,
                  paths)


def nested(toy: SpliceToy) -> Answer:
    """Multiverse's nesting: path 1 ("cat+sun") forks a block of its own
    (paths 1.1 and 1.2), joins it and closes; path 2 ("ox") closes."""
    inner = [("1.1", spelled(toy, "cat")), ("1.2", spelled(toy, "sun"))]
    inner_goal = toy.goal(["1.1: cat", "1.2: sun"])
    inner_after = (after_text(toy, [("1.1", "t"), ("1.2", "n")], "so t n") +
                   f"\n{toy.path_close}")
    first = (f" cat+sun\n{inner_goal}" + joined(toy, inner) +
             f"{toy.after_open}\n{inner_after}")
    paths = [("1", first), ("2", spelled(toy, "ox"))]
    goal = toy.goal(["1: cat+sun", "2: ox"])
    after = after_text(toy, [("1", "t n"), ("2", "x")], "answer t n x")
    nodes = {
        "":
        Node(toy.ids(goal),
             toy.ids(after) + [toy.eos]),
        "1":
        Node(toy.ids(f" cat+sun\n{inner_goal}"),
             toy.ids(inner_after) + toy.ids(PAD)),
        "2":
        path(toy, paths[1][1]),
    }
    nodes.update((label, path(toy, text)) for label, text in inner)
    return Answer(nodes,
                  goal + joined(toy, paths) + f"{toy.after_open}\n" + after,
                  paths)


@dataclass
class Run:
    """A scheduler serving scripted answers, its driver and what it
    scheduled."""

    toy: SpliceToy
    scheduler: Any
    driver: BatchQueueDriver
    # Each step scheduled: its tokens per request and its splice step.
    steps: list[tuple[dict[str, int], Any]] = field(default_factory=list)

    def add(self, request_id: str, max_tokens: int = 200, **params) -> None:
        self.driver.add(
            make_request(self.scheduler, request_id, self.toy.ids(PROMPT),
                         max_tokens, self.toy.eos, **params))

    def answer(self, request_id: str) -> list[int]:
        """The tokens the request's outputs gave."""
        return [
            t for r, new, _ in self.driver.outputs if r == request_id
            for t in new
        ]

    def finish(self) -> None:
        """Steps to the end, failing if the scheduler is stuck: a step
        that schedules nothing with no batch in flight leaves it as it
        was, so an engine core would step so for ever."""
        idle = 0
        while self.scheduler.has_requests():
            steps = self.driver.steps
            self.driver.step()
            idle = 0 if self.driver.steps > steps else idle + 1
            assert idle < STALL, self.stuck()
        self.driver.run()

    def stuck(self) -> str:
        """What a stuck scheduler holds, for the failure."""
        pool = self.scheduler.kv_cache_manager.block_pool
        held = {
            request_id: (request.status.name, request.num_computed_tokens,
                         request.num_tokens)
            for request_id, request in self.scheduler.requests.items()
        }
        return (f"stuck: nothing scheduled, {pool.get_num_free_blocks()} "
                f"free blocks, requests (status, computed, tokens): {held}")


def start(fmt: str, async_scheduling: bool, nodes: dict[str, Node],
          **config) -> Run:
    """A scheduler serving ``fmt`` with the scripts ``nodes``
    (``config``: `make_scheduler`'s)."""
    toy = TOYS[fmt]
    scheduler = make_scheduler(SequenceHookScheduler,
                               toy.model,
                               async_scheduling,
                               special_kwargs={"format": fmt},
                               **config)
    run = Run(
        toy, scheduler,
        BatchQueueDriver(scheduler,
                         scripted(scheduler, toy, nodes),
                         depth=2 if async_scheduling else 1))
    schedule = scheduler.schedule

    def recorded():
        output = schedule()
        run.steps.append((dict(output.num_scheduled_tokens),
                          getattr(output, STEP_ATTRIBUTE, None)))
        return output

    scheduler.schedule = recorded
    return run


def assert_clean(scheduler) -> None:
    assert scheduler.requests == {}
    assert scheduler.hooks.coordinator.num_members() == 0
    assert len(scheduler.hooks.members) == 0
    assert scheduler.hooks.coordinator.num_parked() == 0
    assert scheduler.hooks.splicing.maps == {}
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def scheduled(run: Run, request_id: str) -> list[int]:
    """The tokens each step scheduled of a request."""
    return [
        counts[request_id] for counts, _ in run.steps if request_id in counts
    ]


def last_map(run: Run, request_id: str) -> tuple:
    """The last position map the model runners were given for a
    request."""
    maps = [
        step.position_maps[request_id] for _, step in run.steps
        if step is not None and request_id in step.position_maps
    ]
    return maps[-1]


def position(position_map: tuple, index: int) -> int:
    """An index's position by a position map."""
    return index + int(deltas(position_map, np.array([index]))[0])


def children(tree: dict) -> list[tuple]:
    """Each path's label, tokens and finish reason."""
    return [(c["label"], c["token_ids"], c["finish_reason"])
            for c in tree["children"]]


@functools.cache
def alone(fmt: str, async_scheduling: bool) -> tuple:
    """The two-path answer run alone: its outputs and tree."""
    run = start(fmt, async_scheduling, block(TOYS[fmt], WORDS[:2]).nodes)
    run.add("r0")
    run.finish()
    assert_clean(run.scheduler)
    return run.driver.outputs, run.driver.trees["r0"]


@pytest.mark.parametrize("num_paths", [1, 2, 5])
@ASYNC
@pytest.mark.parametrize("fmt", FORMATS)
def test_paths_join_into_the_answer_and_leave_nothing(fmt, async_scheduling,
                                                      num_paths):
    """The answer: the root's goal, the paths' texts as the join places
    them, the closing tag and what the root wrote after it; the tree: each
    path with its label and its tokens (its forced newline last, the token
    after it dropped)."""
    toy = TOYS[fmt]
    answer = block(toy, WORDS[:num_paths])
    run = start(fmt, async_scheduling, answer.nodes)
    run.add("r0")
    run.finish()
    assert run.answer("r0") == toy.ids(answer.text) + [toy.eos]
    assert run.driver.outputs[-1][2] == "stop"
    assert children(run.driver.trees["r0"]) == [
        (label, toy.ids(text + "\n"), "stop") for label, text in answer.paths
    ]
    assert_clean(run.scheduler)


@ASYNC
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_join_computes_its_closing_tag_alone_at_the_trained_positions(
        fmt, async_scheduling):
    """What the scheduler gave each member to compute: a path its goal's
    closing tag, the newline and its header first, then a token a step and
    its closing tag with its newline; the root, at the join, the closing
    tag and its newline alone. The positions the model runners were told:
    each path's header from G + 1 (G the goal's closing tag's), each
    path's closing tag at G + L (L its length from its header on), and the
    root's closing tag one past the longest path, G + max L + 1."""
    toy = TOYS[fmt]
    answer = block(toy, WORDS[:2])
    run = start(fmt, async_scheduling, answer.nodes)
    run.add("r0")
    run.finish()
    prompt, closing = toy.ids(PROMPT), toy.ids(f"{toy.after_open}\n")
    counts = scheduled(run, "r0")
    assert counts[0] == len(prompt)
    assert [n for n in counts[1:] if n != 1] == [len(closing)]
    goal_close = len(prompt) + len(answer.nodes[""].before) - 1
    lengths = []
    for i, (label, text) in enumerate(answer.paths):
        header = toy.ids(toy.header(label))
        counts = scheduled(run, f"r0/promise-{i}")
        assert counts[0] == 2 + len(header)
        assert [n for n in counts[1:] if n != 1] == [2]
        path_map = last_map(run, f"r0/promise-{i}")
        assert position(path_map, goal_close + 2) == goal_close + 1
        lengths.append(len(header) + len(toy.ids(text)))
        closed = goal_close + 1 + lengths[-1]
        assert position(path_map, closed) == goal_close + lengths[-1]
    tokens = prompt + run.answer("r0")
    root_map = last_map(run, "r0")
    tag = tokens.index(toy.id_of(toy.after_open))
    assert position(root_map, tag) == goal_close + max(lengths) + 1
    # Each spliced path's closing tag keeps its own position.
    closes = [
        i for i, t in enumerate(tokens) if t == toy.id_of(toy.path_close)
    ]
    assert [position(root_map, i)
            for i in closes] == [goal_close + n for n in lengths]


# Goals that fork nothing: the root decodes on past the closing tag.
NO_FORK = {
    "six labels": [f"{i}: ox" for i in range(1, 7)],
    "no label": [],
}


@pytest.mark.parametrize("goal", sorted(NO_FORK))
@ASYNC
@pytest.mark.parametrize("fmt", FORMATS)
def test_more_labels_than_five_or_none_fork_nothing(fmt, async_scheduling,
                                                    goal):
    """No path forks: the root decodes on to its EOS, its tree has no
    child and no request but the root was ever scheduled."""
    toy = TOYS[fmt]
    script = toy.ids(toy.goal(NO_FORK[goal]) + " so x") + [toy.eos]
    run = start(fmt, async_scheduling, {"": Node(script, [])})
    run.add("r0")
    run.finish()
    assert run.answer("r0") == script
    assert run.driver.trees["r0"]["children"] == []
    assert all("/" not in r for counts, _ in run.steps for r in counts)
    assert_clean(run.scheduler)


# A path's budget: the window left after its context.
PATH_BUDGET = 20


def ending(toy: SpliceToy, how: str) -> tuple[dict[str, Node], str, dict]:
    """A two-path answer whose paths do not all close: its scripts, the
    answer's text up to where it ends and `make_scheduler`'s config."""
    answer = block(toy, WORDS[:2])
    goal = toy.goal(["1: ox", "2: banana"])
    first = answer.paths[0]
    if how == "first path's EOS":
        cut = " ox = o"
        return ({
            **answer.nodes, "1": Node(toy.ids(cut) + [toy.eos], [])
        }, goal + "\n" + toy.header("1") + cut + toy.tokenizer.eos_token, {})
    shown = goal + joined(toy, [first]) + toy.header("2")
    if how == "last path's EOS":
        cut = " banana = b a"
        return ({
            **answer.nodes,
            "2": Node(toy.ids(cut) + [toy.eos], []),
        }, shown + cut + toy.tokenizer.eos_token, {})
    # The window: path 2 never closes and runs out of room; the answer,
    # which holds path 1 too, is cut at the window, as decoding the paths
    # in turn would stop there.
    endless = toy.ids(" banana = b a n a n a" + " so a" * 50)
    context = len(toy.ids(PROMPT + goal + "\n" + toy.header("2")))
    window = context + PATH_BUDGET
    answer_ids = toy.ids(shown) + endless[:PATH_BUDGET]
    return ({
        **answer.nodes, "2": Node(endless, [])
    }, toy.tokenizer.decode(answer_ids[:window - len(toy.ids(PROMPT))]), {
        "max_model_len": window
    })


ENDINGS = ["first path's EOS", "last path's EOS", "a path's window"]


@pytest.mark.parametrize("how", ENDINGS)
@ASYNC
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_path_that_ends_otherwise_ends_the_answer(fmt, async_scheduling,
                                                    how):
    """The answer ends with the paths' text up to and including the path
    that did not close, as decoding them in turn would (`Conclude`):
    finish "stop" at a path's EOS, "length" where the window cut it;
    nothing held (the closed paths' kept blocks freed)."""
    toy = TOYS[fmt]
    nodes, text, config = ending(toy, how)
    run = start(fmt, async_scheduling, nodes, **config)
    run.add("r0")
    run.finish()
    assert toy.tokenizer.decode(run.answer("r0")) == text
    if how == "a path's window":
        assert run.driver.outputs[-1][2] == "length"
        reasons = [
            c["finish_reason"] for c in run.driver.trees["r0"]["children"]
        ]
        assert reasons == ["stop", "length"]
    else:
        assert run.driver.outputs[-1][2] == "stop"
    assert_clean(run.scheduler)


@pytest.mark.parametrize("how", ["EOS", "a stop id", "a stop string"])
@ASYNC
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_path_ended_at_the_token_after_its_newline_is_joined(
        fmt, async_scheduling, how):
    """Whatever ends a path at the token it samples after its newline
    (an EOS, or the request's stop id or stop string there: upstream or
    the plugin ends it, not the format), the path closed: its blocks are
    kept, the join splices it, and the answer is the one alone."""
    toy = TOYS[fmt]
    nodes = dict(block(toy, WORDS[:2]).nodes)
    params = {}
    if how == "EOS":
        nodes.update((label, Node(node.before[:-1] + [toy.eos], []))
                     for label, node in nodes.items() if label)
    elif how == "a stop id":
        params["stop_token_ids"] = toy.ids(PAD)
    else:
        params["stop"] = [PAD]
    run = start(fmt, async_scheduling, nodes)
    run.add("r0", **params)
    run.finish()
    outputs, tree = alone(fmt, async_scheduling)
    assert run.answer("r0") == [t for r, new, _ in outputs for t in new]
    assert children(run.driver.trees["r0"]) == children(tree)
    # Spliced: no path was computed again.
    assert any(step is not None and step.token_copies for _, step in run.steps)
    assert_clean(run.scheduler)


@ASYNC
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_join_past_the_requests_budget_ends_the_answer_there(
        fmt, async_scheduling):
    """The paths closed, but the splice would reach the request's
    `max_tokens`: the answer is the paths' text and the closing tokens
    cut to the budget, not computed, finish "length" (`Conclude`); a
    budget that the closing tokens fill exactly holds all of them."""
    toy = TOYS[fmt]
    answer = block(toy, WORDS[:2])
    goal = answer.nodes[""].before
    shown = toy.ids(
        toy.tokenizer.decode(goal) + joined(toy, answer.paths) +
        f"{toy.after_open}\n")
    for budget in (len(goal) + 10, len(shown)):
        run = start(fmt, async_scheduling, answer.nodes)
        run.add("r0", max_tokens=budget)
        run.finish()
        assert run.answer("r0") == shown[:budget]
        assert run.driver.outputs[-1][2] == "length"
        assert_clean(run.scheduler)


@ASYNC
def test_a_path_forks_a_block_of_its_own(async_scheduling):
    """Multiverse nests: path 1 forks paths 1.1 and 1.2, which its own
    join splices into it; then the root's join splices paths 1 (with its
    block) and 2."""
    toy = TOYS["multiverse"]
    answer = nested(toy)
    run = start("multiverse", async_scheduling, answer.nodes)
    joins, join = [], run.scheduler.hooks.splicing.join

    def recorded(parent, *args):
        joins.append(parent.request_id)
        return join(parent, *args)

    run.scheduler.hooks.splicing.join = recorded
    run.add("r0")
    run.finish()
    assert run.answer("r0") == toy.ids(answer.text) + [toy.eos]
    assert joins == ["r0/promise-0", "r0"]
    tree = run.driver.trees["r0"]
    assert children(tree) == [(label, toy.ids(text + "\n"), "stop")
                              for label, text in answer.paths]
    assert children(tree["children"][0]) == [
        (label, toy.ids(spelled(toy, word) + "\n"), "stop")
        for label, word in [("1.1", "cat"), ("1.2", "sun")]
    ]
    assert_clean(run.scheduler)


@ASYNC
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_sample_of_an_n_2_request_answers_with_its_tree(
        fmt, async_scheduling):
    """V1's frontend sends an `n > 1` request's samples as requests
    "<index>_<id>", each seeded with the seed plus its index
    (`ParentRequest.get_child_info`); the last sample to finish carries
    every sample's tree (`promise_trees`)."""
    toy = TOYS[fmt]
    answer = block(toy, WORDS[:2])
    run = start(fmt, async_scheduling, answer.nodes)
    finals, update = {}, run.scheduler.update_from_output

    def recorded(*args):
        outputs = update(*args)
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                if out.finish_reason is not None:
                    finals[out.request_id] = out.kv_transfer_params
        return outputs

    run.scheduler.update_from_output = recorded
    for index in range(2):
        run.add(f"{index}_r0", seed=3 + index)
    run.finish()
    for index in range(2):
        assert run.answer(f"{index}_r0") == toy.ids(answer.text) + [toy.eos]
    trees = finals["1_r0"]["promise_trees"]
    assert sorted(trees) == ["0", "1"]
    for tree in trees.values():
        assert children(tree) == [(label, toy.ids(text + "\n"), "stop")
                                  for label, text in answer.paths]
    assert_clean(run.scheduler)


def after_join(scheduler, request_id: str) -> int:
    """Tokens a member has after its join's closing tag, which no prompt
    holds (-1 before the join; 0 while the closing tokens are not
    computed)."""
    request = scheduler.requests.get(request_id)
    toy = TOYS[scheduler.hooks.special_kwargs.format]
    tag = toy.id_of(toy.after_open)
    if request is None or tag not in request.all_token_ids:
        return -1
    tokens = request.all_token_ids
    at = len(tokens) - 1 - tokens[::-1].index(tag)
    if request.num_computed_tokens <= at:
        return 0
    return len(tokens) - at - 2


# Path 0's own tokens at its end: "ox" spelled and closed, its newline and
# the token it ends at (as many in both formats: every tag is one token).
OX_PATH = len(TOYS["npr"].ids(spelled(TOYS["npr"], "ox"))) + 2
# Where the answer is aborted, by what the scheduler holds after a step.
# Path 1 ("banana") runs on after path 0 ("ox").
STAGES = {
    **fork_stages("the fork", "path", OX_PATH),
    "right after the join":
    lambda s: after_join(s, "r0") == 0,
    "after the join":
    lambda s: after_join(s, "r0") >= 2,
    "after the answer":
    None,
}


def abort_and_next(run: Run, reached, stage: str) -> int:
    """Runs the answer "r0" to the stage, aborts it as the engine core
    does for a client gone, checks that nothing is held, then runs "r1"
    on the same scheduler.

    Returns:
        How many outputs the driver had given before "r1".
    """
    run.add("r0")
    if reached is None:
        run.finish()
    else:
        run.driver.run_until(reached, stage)
    given, steps = len(run.driver.outputs), len(run.steps)
    run.driver.abort("r0")
    assert run.driver.outputs[given:] == []
    if reached is not None:
        assert "r0" not in run.driver.trees
        assert all(reason is None for _, _, reason in run.driver.outputs)
    assert_clean(run.scheduler)
    given = len(run.driver.outputs)
    run.add("r1")
    run.finish()
    # No later step tells the model runners of the aborted tree.
    assert [
        request_id for _, step in run.steps[steps:] if step is not None
        for request_id in step.position_maps if request_id.startswith("r0")
    ] == []
    assert_clean(run.scheduler)
    return given


@pytest.mark.parametrize("stage", list(STAGES))
@ASYNC
@pytest.mark.parametrize("fmt", FORMATS)
def test_an_aborted_answer_leaves_nothing_and_the_next_runs_as_alone(
        fmt, async_scheduling, stage):
    """The engine core's abort (`finish_requests`, FINISHED_ABORTED) at
    each point of the answer: no output (after the answer, none more),
    nothing held at once, and the next request's outputs and tree are
    those of the answer run alone."""
    run = start(fmt, async_scheduling, block(TOYS[fmt], WORDS[:2]).nodes)
    given = abort_and_next(run, STAGES[stage], stage)
    outputs, tree = alone(fmt, async_scheduling)
    assert run.driver.outputs[given:] == [("r1", new, reason)
                                          for _, new, reason in outputs]
    assert children(run.driver.trees["r1"]) == children(tree)


NESTED_STAGES = {
    "inner paths running": lambda s: own_tokens(s, "r0/promise-3") >= 2,
    "right after the inner join": lambda s: after_join(s, "r0/promise-0") == 0,
}


@pytest.mark.parametrize("stage", list(NESTED_STAGES))
@ASYNC
def test_a_nested_block_aborted_leaves_nothing(async_scheduling, stage):
    toy = TOYS["multiverse"]
    answer = nested(toy)
    run = start("multiverse", async_scheduling, answer.nodes)
    given = abort_and_next(run, NESTED_STAGES[stage], stage)
    assert run.answer("r1") == toy.ids(answer.text) + [toy.eos]
    assert run.driver.outputs[given:][-1][2] == "stop"


def preempted(run: Run) -> list[str]:
    """Records each request the scheduler preempts, by id."""
    record, preempt = [], run.scheduler._preempt_request

    def recorded(request, *args, **kwargs):
        record.append(request.request_id)
        return preempt(request, *args, **kwargs)

    run.scheduler._preempt_request = recorded
    return record


# Two trees at once on a pool of one tree's peak (8 blocks on a roomy
# pool), and the null block.
TWO_TREES_BLOCKS = 9


@ASYNC
@pytest.mark.parametrize("fmt", FORMATS)
def test_paths_preempted_for_blocks_compute_again_and_the_trees_finish(
        fmt, async_scheduling):
    """Upstream preempts paths for blocks; each computes again from its
    context and tokens, and both answers are those of a roomy pool."""
    toy = TOYS[fmt]
    answer = block(toy, WORDS[:2])
    run = start(fmt,
                async_scheduling,
                answer.nodes,
                num_blocks=TWO_TREES_BLOCKS)
    record = preempted(run)
    run.add("r0")
    run.add("r1")
    run.finish()
    assert any("/" in request_id for request_id in record), record
    for request_id in ("r0", "r1"):
        assert run.answer(request_id) == toy.ids(answer.text) + [toy.eos]
    assert_clean(run.scheduler)


# Two trees whose roots write on after their joins, on a pool that holds
# both joins but not both answers.
LONG_AFTER_BLOCKS = 20


@ASYNC
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_preempted_spliced_member_is_computed_again_from_its_tokens(
        fmt, async_scheduling):
    """docs/formats.md: "A spliced member that is preempted is computed
    again by its resume from its tokens": its position map stays; at its
    first readmission no block past its fork comes back from the prefix
    cache (the join's blocks are its paths', their hashes salted with the
    paths' own values; once computed again they are its own, which a
    later readmission may hit); the answers are those of a roomy pool."""
    toy = TOYS[fmt]
    answer = block(toy, WORDS[:2])
    root = answer.nodes[""]
    long = " t x" * 20
    nodes = {
        **answer.nodes, "":
        Node(root.before, root.after[:-1] + toy.ids(long) + [toy.eos])
    }
    run = start(fmt, async_scheduling, nodes, num_blocks=LONG_AFTER_BLOCKS)
    maps = run.scheduler.hooks.splicing.maps
    # Each spliced member preempted, in order.
    spliced = []
    # Each spliced member preempted, until its readmission: its map then.
    waiting: dict[str, tuple] = {}
    # Each readmission: the member and the tokens the prefix cache gave.
    readmitted = []
    preempt = run.scheduler._preempt_request

    def recorded(request, *args, **kwargs):
        if "/" not in request.request_id and request.request_id in maps:
            spliced.append(request.request_id)
            waiting[request.request_id] = maps[request.request_id]
        return preempt(request, *args, **kwargs)

    run.scheduler._preempt_request = recorded
    schedule = run.scheduler.schedule

    def readmissions():
        output = schedule()
        for request_id in list(waiting):
            if request_id in output.num_scheduled_tokens:
                request = run.scheduler.requests[request_id]
                if request_id not in {r for r, _ in readmitted}:
                    readmitted.append(
                        (request_id, request.num_computed_tokens -
                         output.num_scheduled_tokens[request_id]))
                assert maps[request_id] == waiting.pop(request_id)
        return output

    run.scheduler.schedule = readmissions
    run.add("r0")
    run.add("r1")
    run.finish()
    assert spliced
    goal_close = len(toy.ids(PROMPT)) + len(root.before) - 1
    block_size = run.scheduler.block_size
    assert [r for r, _ in readmitted] == list(dict.fromkeys(spliced))
    assert all(hit <= goal_close // block_size * block_size
               for _, hit in readmitted), readmitted
    text = answer.text + long
    for request_id in ("r0", "r1"):
        assert run.answer(request_id) == toy.ids(text) + [toy.eos]
    assert_clean(run.scheduler)


# Three paths: the join needs fresh blocks for the later two's copies.
THREE = ["banana", "orange", "garden"]


@functools.cache
def peak(fmt: str, async_scheduling: bool) -> int:
    """The most blocks the three-path answer holds after a step on a
    roomy pool."""
    run = start(fmt, async_scheduling, block(TOYS[fmt], THREE).nodes)
    pool = run.scheduler.kv_cache_manager.block_pool
    run.add("r0")
    most = 0
    while run.scheduler.has_requests():
        run.driver.step()
        most = max(most, pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
    run.driver.run()
    return most


@pytest.mark.parametrize("short", [0, 1, 2], ids=lambda n: f"short-{n}")
@ASYNC
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_tree_on_a_pool_at_or_below_its_peak_finishes_or_ends_cleanly(
        fmt, async_scheduling, short):
    """One tree on a pool of its peak use on a roomy pool, or ``short``
    blocks fewer (each still more than its longest request needs): it
    finishes with the roomy answer (members preempted or waiting, a join
    short of fresh blocks computing its member again from its tokens);
    the scheduler is never stuck, raises nothing and holds nothing."""
    toy = TOYS[fmt]
    answer = block(toy, THREE)
    blocks = peak(fmt, async_scheduling) - short
    # Room for the longest request (the root) alone, as upstream needs.
    assert blocks * BLOCK_SIZE > len(toy.ids(PROMPT + answer.text)) + 1
    run = start(fmt, async_scheduling, answer.nodes, num_blocks=blocks + 1)
    run.add("r0")
    run.finish()
    assert run.driver.outputs[-1][2] is not None
    got, roomy = run.answer("r0"), toy.ids(answer.text) + [toy.eos]
    assert got == roomy
    assert_clean(run.scheduler)
