# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`Coordinator`'s decisions, one by one, on the model-free engine.

Each test drives `FakeEngine` through a short program and checks what the
coordinator told the engine (forks, parks, resumes, aborts, reports)
against values written out by hand from the contract.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from fake_engine import (OFFSET, PROMISE, ROLE, SYNC, FakeEngine,
                         sampled_logprob)
from reference import seed_for

import sequence_hooks
from sequence_hooks.actions import (Abort, Fork, Park, RequestParams, Resume,
                                    StartTree)

A, B, C = (OFFSET + ord(char) for char in "abc")


def start(engine: FakeEngine,
          request_id: str = "r",
          prompt=(A, B),
          logprobs: bool = False,
          **params) -> None:
    engine.add_request(
        request_id, list(prompt),
        RequestParams(len(prompt), **{
            "max_tokens": None,
            **params
        }), logprobs)


def finish(engine: FakeEngine, member_id: str, reason: str = "stop") -> None:
    engine.stop(member_id, reason)
    engine.report(member_id)


def play(engine: FakeEngine, *program: tuple[str, int]) -> None:
    """Samples each ``(member_id, token)`` of ``program`` in turn.

    Args:
        engine: The engine.
        program: The members and the tokens they sample, in order.
    """
    for member_id, token in program:
        engine.sample(member_id, token)


def test_the_package_imports_no_vllm():
    """The contract runs with no vLLM installed (the client join and
    engine-neutral tools need only this package)."""
    code = ("import sys, sequence_hooks, sequence_hooks.lifecycle, "
            "sequence_hooks.tree, sequence_hooks.metrics, "
            "sequence_hooks.ordering, sequence_hooks.training_records\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == "
            "'vllm'))")
    out = subprocess.run([sys.executable, "-c", code],
                         check=True,
                         capture_output=True,
                         text=True).stdout
    assert out.strip() == "[]"


# The lifecycle's modules: the coordinator, its records and the formats
# (the metrics module is the adapters' exporter).
LIFECYCLE = [
    path for path in Path(sequence_hooks.__file__).parent.rglob("*.py")
    if path.name != "metrics.py"
]


@pytest.mark.parametrize("path", LIFECYCLE, ids=lambda path: path.name)
def test_the_lifecycle_reads_no_clock_and_exports_no_metric(path):
    """The coordinator asks the engine nothing and keeps its own counts:
    time comes from the clock it is given, metrics are the adapters'."""
    tree = ast.parse(path.read_text())
    imported = {
        alias.name
        for node in ast.walk(tree) if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module
        for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    }
    assert not imported & {
        "time", "prometheus_client", "sequence_hooks.metrics"
    }


def test_a_parked_time_is_the_given_clocks():
    """Parked at the sync (the fake engine's clock: a second a sample),
    resumed when its child ends a sample later: one second, taken once."""
    engine = FakeEngine()
    start(engine)
    play(engine, ("r", PROMISE), ("r", SYNC), ("r/promise-0", A))
    finish(engine, "r/promise-0")
    assert engine.coordinator.counts.take_blocked_times() == [1.0]
    assert engine.coordinator.counts.take_blocked_times() == []


def test_child_ids_count_the_whole_tree_from_zero():
    engine = FakeEngine(limits={"max_depth": 3})
    start(engine)
    play(engine, ("r", PROMISE), ("r", PROMISE), ("r/promise-0", PROMISE))
    assert [(spec.request_id, spec.parent_id)
            for spec in engine.forks] == [("r/promise-0", "r"),
                                          ("r/promise-1", "r"),
                                          ("r/promise-2", "r/promise-0")]


def test_a_child_is_forked_on_its_parents_whole_context_and_marker():
    engine = FakeEngine()
    start(engine, prompt=(A, B))
    play(engine, ("r", C), ("r", PROMISE))
    assert engine.members["r/promise-0"].tokens == [A, B, C, PROMISE, ROLE]
    assert engine.forks[0].context_tokens == (ROLE, )


def test_a_seeded_childs_seed_derives_from_its_parent_and_its_index():
    """Kills: a child given its parent's seed, the same seed for siblings,
    or the index counted over the tree instead of the parent."""
    engine = FakeEngine(limits={"max_depth": 3})
    start(engine, seed=1234)
    play(engine, ("r", PROMISE), ("r", PROMISE), ("r/promise-0", PROMISE))
    seeds = [spec.seed for spec in engine.forks]
    first = seed_for(1234, "child-0")
    assert seeds == [
        first, seed_for(1234, "child-1"),
        seed_for(first, "child-0")
    ]
    assert len(set(seeds)) == 3 and 1234 not in seeds
    assert all(0 <= seed < 2**63 for seed in seeds)


def test_an_unseeded_requests_children_are_unseeded():
    engine = FakeEngine()
    start(engine)
    engine.sample("r", PROMISE)
    assert engine.forks[0].seed is None


def test_a_resume_that_reseeds_gives_later_children_the_new_seed():
    engine = FakeEngine(reseeds=True)
    start(engine, seed=7)
    engine.sample("r", PROMISE)
    finish(engine, "r/promise-0")
    engine.sample("r", SYNC)
    resumed = seed_for(7, "resume-1")
    assert engine.resumes[0][1].seed == resumed
    engine.sample("r", PROMISE)
    assert engine.forks[1].seed == seed_for(resumed, "child-1")


def test_a_child_gets_its_requests_budget_minimum_and_stop_strings():
    """Kills: a child's `min_tokens` (or budget, or stop strings) not
    passed on."""
    engine = FakeEngine()
    start(engine, max_tokens=30, min_tokens=4, stop=("xy", ))
    engine.sample("r", PROMISE)
    spec = engine.forks[0]
    assert (spec.max_tokens, spec.min_tokens, spec.stop) == (30, 4, ("xy", ))


@pytest.mark.parametrize("show_hooks", [True, False])
def test_hook_tokens_never_reach_a_text_or_a_merge(show_hooks):
    """Kills: hook token strings left in a member's text (the engine's
    detokenized text shows them) or hook ids decoded into it."""
    engine = FakeEngine(show_hooks=show_hooks)
    start(engine)
    engine.sample("r", PROMISE)
    child = "r/promise-0"
    play(engine, (child, A), (child, PROMISE), ("r/promise-1", C))
    finish(engine, "r/promise-1")
    play(engine, (child, B), (child, SYNC))
    finish(engine, child)
    engine.sample("r", SYNC)
    # The root merges the child's text: its own tokens and the
    # grandchild's merged "c", no hook token.
    assert list(
        engine.resumes[-1][1].token_ids) == engine.tokenizer.encode("abc")
    finish(engine, "r")
    tree = engine.reports["r"]
    assert tree.children[0].token_ids == (A, PROMISE, B, SYNC, C)
    assert [
        node.text
        for node in (tree, tree.children[0], tree.children[0].children[0])
    ] == ["abc", "abc", "c"]


def test_a_parked_parent_resumes_only_when_its_last_child_finishes():
    """Kills: waking a parked parent while a sibling still runs (the
    `has_unfinished_seqs` branch)."""
    engine = FakeEngine()
    start(engine)
    play(engine, ("r", PROMISE), ("r", PROMISE), ("r/promise-0", A),
         ("r/promise-1", B), ("r", SYNC))
    assert engine.members["r"].parked
    assert "r" in engine.coordinator.parked_members()
    finish(engine, "r/promise-1")
    assert engine.members["r"].parked and engine.resumes == []
    finish(engine, "r/promise-0")
    assert not engine.members["r"].parked
    assert list(
        engine.resumes[0][1].token_ids) == engine.tokenizer.encode("a\nb")
    assert engine.metrics.parents_parked.value == 0
    assert engine.metrics.syncs_blocked.value == 1


def test_a_sync_whose_children_all_finished_merges_at_once():
    engine = FakeEngine()
    start(engine)
    play(engine, ("r", PROMISE), ("r/promise-0", A))
    finish(engine, "r/promise-0")
    assert engine.sample("r", SYNC) == [Resume("r", (A, ), 0.0, None)]
    assert engine.members["r"].tokens[-2:] == [SYNC, A]
    assert engine.metrics.syncs_blocked.value == 0


def test_a_sync_with_nothing_to_merge_is_an_ordinary_token():
    engine = FakeEngine()
    start(engine)
    assert engine.sample("r", SYNC) == []
    engine.sample("r", PROMISE)
    finish(engine, "r/promise-0")
    # The child wrote nothing: its merge appends nothing.
    assert engine.sample("r", SYNC) == [Resume("r", (), 0.0, None)]
    assert engine.sample("r", SYNC) == []
    assert not engine.members["r"].parked


def test_a_merge_leaves_room_for_one_sampled_token():
    engine = FakeEngine(max_model_len=64)
    start(engine, prompt=(A, ), max_tokens=6)
    engine.sample("r", PROMISE)
    for _ in range(5):
        engine.sample("r/promise-0", B)
    finish(engine, "r/promise-0")
    engine.sample("r", SYNC)
    # 2 own tokens, budget 6: 3 merged, one left to sample.
    assert engine.resumes[0][1].token_ids == (B, ) * 3
    engine.sample("r", C)
    finish(engine, "r", "length")
    assert engine.reports["r"].merged_spans == ((2, 3), )


def test_merged_tokens_have_no_logprobs_and_leave_the_cumulative():
    engine = FakeEngine()
    start(engine, logprobs=True)
    play(engine, ("r", PROMISE), ("r/promise-0", A))
    finish(engine, "r/promise-0")
    play(engine, ("r", SYNC), ("r", B))
    finish(engine, "r")
    root = engine.reports["r"]
    assert root.token_ids == (PROMISE, SYNC, A, B)
    assert root.sampled_mask == (True, True, False, True)
    assert root.logprobs[2] is None
    expected = [
        sampled_logprob(PROMISE, 2),
        sampled_logprob(SYNC, 3),
        sampled_logprob(B, 5)
    ]
    assert [
        root.logprobs[i][t].logprob
        for i, t in ((0, PROMISE), (1, SYNC), (3, B))
    ] == expected
    assert root.cumulative_logprob == pytest.approx(sum(expected))


def test_a_finished_member_aborts_its_live_descendants_deepest_first():
    engine = FakeEngine(limits={"max_depth": 3})
    start(engine)
    play(engine, ("r", PROMISE), ("r/promise-0", PROMISE),
         ("r/promise-1", PROMISE), ("r", PROMISE))
    # Finished by the engine, not reported: recorded, never aborted.
    engine.stop("r/promise-3", "stop")
    finish(engine, "r")
    assert engine.aborts == [["r/promise-2", "r/promise-1", "r/promise-0"]]
    engine.report("r/promise-3")
    tree = engine.reports["r"]
    assert [
        node.finish_reason for node in (tree.children[0], tree.children[1])
    ] == ["abort", "abort"]
    assert engine.coordinator.num_members() == 0
    assert engine.metrics.children_running.value == 0


def test_an_aborted_request_ends_its_tree_with_no_report():
    engine = FakeEngine()
    start(engine)
    play(engine, ("r", PROMISE), ("r", SYNC))
    engine.abort_request("r")
    assert engine.aborts == [["r/promise-0"]]
    assert engine.reports == {} and engine.members == {}
    assert engine.coordinator.num_members() == 0
    assert engine.coordinator.num_parked() == 0
    assert engine.metrics.parents_parked.value == 0
    assert engine.metrics.children_running.value == 0


@pytest.mark.parametrize("limits, promises, spawned", [
    ({
        "max_children_per_sequence": 2
    }, ["r"] * 3, 2),
    ({
        "max_children_per_request": 2,
        "max_depth": 3
    }, ["r", "r/promise-0", "r/promise-1"], 2),
    ({
        "max_depth": 1
    }, ["r", "r/promise-0"], 1),
])
def test_a_promise_past_a_limit_spawns_nothing(limits, promises, spawned):
    engine = FakeEngine(limits=limits)
    start(engine)
    for member_id in promises:
        engine.sample(member_id, PROMISE)
    assert len(engine.forks) == spawned
    assert engine.metrics.promises_refused.value == len(promises) - spawned
    assert engine.coordinator.tree_of("r").num_refused == (len(promises) -
                                                           spawned)


def test_only_roots_are_visible_and_critical_path_is_what_a_root_awaits():
    engine = FakeEngine()
    start(engine)
    start(engine, "plain")
    engine.sample("r", PROMISE)
    coordinator = engine.coordinator
    assert coordinator.is_child("r/promise-0")
    assert not coordinator.is_child("r") and not coordinator.is_child("plain")
    assert not coordinator.on_critical_path("r/promise-0")
    engine.sample("r", SYNC)
    assert coordinator.on_critical_path("r/promise-0")
    assert not coordinator.on_critical_path("plain")
    finish(engine, "r/promise-0")
    assert coordinator.on_critical_path("r")


def test_every_member_names_its_trees_root_until_the_tree_ends():
    """What an adapter reports for a child under its root (the V1
    scheduler's children's preemptions): nested members included, nothing
    once the tree is gone."""
    engine = FakeEngine(limits={"max_depth": 3})
    start(engine)
    play(engine, ("r", PROMISE), ("r/promise-0", PROMISE))
    coordinator = engine.coordinator
    assert [
        coordinator.root_of(member)
        for member in ("r", "r/promise-0", "r/promise-1", "other")
    ] == ["r", "r", "r", None]
    coordinator.aborted("r")
    assert coordinator.root_of("r/promise-1") is None


def test_a_sampled_token_is_a_promise_a_sync_or_no_event():
    """`sampled`, the one entry every adapter calls with a member's
    tokens, the sampled one last; its request's parameters are read for a
    promise only."""
    engine = FakeEngine()
    start(engine)
    coordinator = engine.coordinator
    reads = []

    def params():
        reads.append(True)
        return RequestParams(2, None)

    assert coordinator.sampled("r", [A, B, A], params) == []
    assert not coordinator.is_member("r") and not reads
    start_tree, fork = engine.carry_out(
        coordinator.sampled("r", [A, B, A, PROMISE], params))
    assert start_tree == StartTree("r", coordinator.tree_of("r"))
    assert fork.request_id == "r/promise-0" and reads == [True]
    assert fork.context_tokens == (ROLE, )
    assert coordinator.sampled("r", [A, B, A, PROMISE, SYNC],
                               params) == [Park("r")]
    assert reads == [True]
    assert not coordinator.is_finished("r/promise-0")


def test_each_event_returns_the_actions_of_the_table():
    """docs/architecture.md's event -> actions table, row by row, on one
    tree: the values returned, in order, are all the engine is told."""
    engine = FakeEngine(limits={"max_depth": 2})
    start(engine, max_tokens=20)
    first = engine.sample("r", PROMISE)
    assert [type(a) for a in first] == [StartTree, Fork]
    assert engine.sample("r", A) == []
    assert engine.sample("r/promise-0", PROMISE) == [
        Fork("r/promise-1", "r/promise-0", (ROLE, ), 20, 0, None, ())
    ]
    assert engine.sample("r", SYNC) == [Park("r")]
    engine.stop("r/promise-1", "stop")
    engine.sample("r/promise-0", B)
    engine.stop("r/promise-0", "stop")
    # Its descendant stopped in the engine: recorded aborted, its `Abort`
    # skipped by the engine; its parent's last awaited child: the
    # parent's merge.
    skipped, resume = engine.report("r/promise-0")
    assert skipped == Abort(("r/promise-1", )) and engine.aborts == []
    assert resume == Resume("r", tuple(engine.tokenizer.encode("b")), 0.0,
                            None)
    assert engine.report("r/promise-1") == []
    assert engine.sample(
        "r", PROMISE) == [Fork("r/promise-2", "r", (ROLE, ), 20, 0, None, ())]
    engine.stop("r", "stop")
    abort, report = engine.report("r")
    assert abort == Abort(("r/promise-2", ))
    assert report.root_id == "r" and [(child.request_id, child.finish_reason)
                                      for child in report.tree.children
                                      ] == [("r/promise-0", "stop"),
                                            ("r/promise-2", "abort")]
    assert engine.coordinator.num_members() == 0
