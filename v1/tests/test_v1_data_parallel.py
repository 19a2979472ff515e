# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Data parallelism: `vllm serve --data-parallel-size 2` (vLLM's internal
load balancer, two engine cores behind one API server) with the plugin.

The same scripted requests (`n = 1` and `n > 1`, completions and chat,
streamed and not) go to a one-engine hooked server and to the two-engine
one; the two-engine answers must be the one-engine answers: the same
texts at temperature 0 (and with the same seeds), every sample's tree by
its choice index. Unpinned requests go out together, so vLLM's load
balancer spreads them; pinned ones (`X-data-parallel-rank`, as a router
sets it) make sure each engine runs trees. When the load is done,
`/metrics` must show nothing held in any engine core (vLLM's requests
and KV usage per engine, the hooks' live children and parked parents
summed over the engines) and the hooks' spawn counter summed over both
engines: every child of every tree. The same again with tensor
parallelism (TP = 2) inside each engine core. The two-engine server is
the suite's shared one (conftest's `shared_servers`): test_v1_engine_death.py
then kills one of its engine cores.

Model-free: the middleware's routing, and the engine core's check (a
dense model's engine core sees one engine; a MoE model's, which keeps
the deployment's size, is refused).
"""

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from vllm_sequence_hooks.data_parallel import SamplesOnOneEngine
from vllm_sequence_hooks.scheduler import SequenceHookScheduler
from vllm_sequence_hooks.transport import SampleTrees

from sequence_hooks_testkit import v1_data_parallel as dp
from sequence_hooks_testkit.programs import programs
from sequence_hooks_testkit.server import stop_server
from sequence_hooks_testkit.v1_batch_queue import make_scheduler
from sequence_hooks_testkit.v1_server import (metric, scripted_body,
                                              start_hooked_v1_server)
from vllm.config import ModelConfig, ParallelConfig
from vllm.engine.arg_utils import EngineArgs

# The shared servers its tests use (conftest's `shared_servers`).
pytestmark = pytest.mark.shares("data parallel")

ENGINES = 2
# (name, program, chat, sampling): sampling None is greedy `n = 1`.
CASES = [
    ("one promise", "one promise", False, None),
    ("nested", "nested", False, None),
    ("two rounds, chat", "two rounds", True, None),
    ("several promises", "several promises", False, None),
    ("n=2 seeded", "one promise", False, {
        "n": 2,
        "temperature": 0.8,
        "seed": 7
    }),
    ("n=3 seeded, chat", "nested", True, {
        "n": 3,
        "temperature": 0.8,
        "seed": 11
    }),
    # V1 refuses n > 1 at temperature 0: top-k 1 is greedy. The seed
    # tells the samples' scripts apart (`v1_scripted_logits`).
    ("n=2 greedy", "two rounds", False, {
        "n": 2,
        "temperature": 1.0,
        "top_k": 1,
        "seed": 3
    }),
]
# Seconds the engines may take to let go of everything once the last
# answer is in (they finish the step they are in).
IDLE_TIMEOUT_S = 60


def body(hook_ids, model_path, case, stream: bool) -> dict:
    """A new request for ``case`` (a script's progress is kept per
    script, so each request gets its own)."""
    _, program, chat, sampling = case
    request = scripted_body(
        programs(hook_ids)[program], hook_ids, model_path, stream, chat)
    request.update(sampling or {})
    return request


@pytest.fixture(scope="module")
def one_engine_answers(tiny_model_path, hook_ids, tmp_path_factory):
    """Every case's non-streamed answer from a one-engine hooked server,
    stopped once they are read."""
    process, url = start_hooked_v1_server(tiny_model_path,
                                          tmp_path_factory.mktemp("one"))
    try:
        return {
            case[0]: dp.answer(url, body(hook_ids, tiny_model_path, case,
                                         False))
            for case in CASES
        }
    finally:
        stop_server(process)


def descendants(tree: dict) -> int:
    return sum(1 + descendants(child) for child in tree["children"])


def wait_idle(url: str) -> dict:
    """What the engines hold once they hold nothing (or the deadline)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    held = dp.held_by_engines(url)
    while (any(held[name] for name in held if name != "engines")
           or any(any(values.values()) for values in held["engines"].values())
           ) and time.monotonic() < deadline:
        time.sleep(0.5)
        held = dp.held_by_engines(url)
    return held


def nothing_held(engines: int) -> dict:
    """What `wait_idle` reads of a server whose ``engines`` engine cores
    hold nothing: no request, no KV block, no child, no parked parent."""
    return {
        "engines": {
            str(rank): {
                "running": 0.0,
                "waiting": 0.0,
                "kv_cache_usage": 0.0
            }
            for rank in range(engines)
        },
        "vllm:sequence_hook_children_running": 0.0,
        "vllm:sequence_hook_parents_parked": 0.0,
    }


def answers_match_one_engine(url, one_engine_answers, tiny_model_path,
                             hook_ids, rounds: int) -> int:
    """Plays every case on a server with `ENGINES` engine cores and checks
    each answer against the one-engine server's.

    Each engine first runs every greedy program's tree, pinned as a router
    pins a request. Then every case goes out ``rounds`` times, streamed and
    not, all at once and unpinned: vLLM's balancer places each `n = 1`
    request, the middleware each `n > 1` request whole.

    Returns:
        The number of children the answers' trees hold.
    """
    spawned = 0
    for rank in range(ENGINES):
        for case in CASES:
            if case[3] is None:
                got = dp.answer(url,
                                body(hook_ids, tiny_model_path, case, False),
                                rank)
                assert got == one_engine_answers[case[0]], (rank, case)
                spawned += descendants(got["trees"][0])
    jobs = [(case, stream) for _ in range(rounds) for case in CASES
            for stream in (False, True)]

    def send(job):
        return dp.answer(url, body(hook_ids, tiny_model_path, *job))

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(send, jobs))
    for (case, stream), got in zip(jobs, answers):
        expected = one_engine_answers[case[0]]
        n = (case[3] or {}).get("n", 1)
        assert sorted(expected["trees"]) == list(range(n))
        assert all(tree["children"] for tree in expected["trees"].values())
        spawned += sum(map(descendants, expected["trees"].values()))
        if stream:
            # A stream carries no `kv_transfer_params`, as with one engine.
            expected = {"texts": expected["texts"]}
        assert got == expected, (case[0], stream)
    return spawned


def play_and_check(url: str, one_engine_answers, tiny_model_path, hook_ids,
                   rounds: int) -> None:
    """`answers_match_one_engine` on an idle server: once idle again,
    nothing may be held in any engine core, and the hooks' spawn counter,
    summed over the engines, must have counted every child of every
    tree."""
    before = metric(url, "promises_spawned_total")
    spawned = answers_match_one_engine(url, one_engine_answers,
                                       tiny_model_path, hook_ids, rounds)
    held = wait_idle(url)
    counted = metric(url, "promises_spawned_total") - before
    assert held == nothing_held(ENGINES)
    assert counted == spawned


def test_two_tensor_parallel_engines_answer_as_one(one_engine_answers,
                                                   tiny_model_path, hook_ids,
                                                   tmp_path_factory,
                                                   monkeypatch):
    """Tensor parallelism inside each engine core (TP = 2 in DP = 2: four
    CPU workers). vLLM slices the binding list by local data-parallel
    rank, two cores an engine."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1|0|1")
    work_dir = tmp_path_factory.mktemp("tp-dp")
    process, url = dp.start_data_parallel_server(tiny_model_path,
                                                 work_dir,
                                                 ENGINES,
                                                 tensor_parallel=2)
    try:
        play_and_check(url,
                       one_engine_answers,
                       tiny_model_path,
                       hook_ids,
                       rounds=1)
    finally:
        stop_server(process)
    assert "tensor_parallel_size=2" in (work_dir / "server.log").read_text()


def test_two_engines_answer_as_one_and_are_left_clean(one_engine_answers,
                                                      tiny_model_path,
                                                      hook_ids,
                                                      shared_servers):
    """On the suite's shared server with `ENGINES` engine cores
    (test_v1_engine_death.py then takes it and kills one of them): after
    the server with tensor parallelism has stopped, so that the two do not
    run at once."""
    play_and_check(shared_servers.get("data parallel").url,
                   one_engine_answers,
                   tiny_model_path,
                   hook_ids,
                   rounds=2)


def routed(body: dict,
           engines: int = 2,
           headers=(),
           path: str = "/v1/completions",
           times: int = 1) -> list[tuple[dict, bytes]]:
    """What the app behind `SamplesOnOneEngine` receives for ``body``
    sent ``times`` times: each request's headers and body."""
    received = []

    async def app(scope, receive, send):
        message = await receive()
        received.append((dict(scope["headers"]), message["body"]))

    parallel = ParallelConfig(data_parallel_size=engines)
    middleware = SamplesOnOneEngine(app)
    scope = {
        "type":
        "http",
        "method":
        "POST",
        "path":
        path,
        "headers":
        list(headers),
        "app":
        SimpleNamespace(state=SimpleNamespace(vllm_config=SimpleNamespace(
            parallel_config=parallel))),
    }
    raw = json.dumps(body).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message):
        pass

    for _ in range(times):
        asyncio.run(middleware(scope, receive, send))
    return received


def test_n_above_one_goes_to_one_engine_in_turn():
    received = routed({"prompt": "a", "n": 3}, times=3)
    assert [headers[b"x-data-parallel-rank"]
            for headers, _ in received] == [b"0", b"1", b"0"]
    # The body reaches the server as sent.
    assert {body for _, body in received} == {b'{"prompt": "a", "n": 3}'}


@pytest.mark.parametrize(
    "body, engines, headers, path", [
        ({
            "prompt": "a"
        }, 2, (), "/v1/completions"),
        ({
            "prompt": "a",
            "n": 1
        }, 2, (), "/v1/completions"),
        ({
            "prompt": "a",
            "n": 2
        }, 1, (), "/v1/completions"),
        ({
            "prompt": "a",
            "n": 2
        }, 2, ((b"X-Data-Parallel-Rank", b"1"), ), "/v1/completions"),
        ({
            "prompt": "a",
            "n": 2
        }, 2, (), "/v1/embeddings"),
    ],
    ids=["n-unset", "n-1", "one-engine", "router-pinned", "other-route"])
def test_everything_else_passes_untouched(body, engines, headers, path):
    [(got, _)] = routed(body, engines, headers, path)
    assert got == dict(headers)


def test_a_dense_models_engine_core_sees_one_engine(tiny_model_path, hook_ids):
    """Pinned upstream behaviour: vLLM rewrites a dense model's engine core
    configuration to one independent engine, so the scheduler starts
    (before, its refusal of data parallelism never fired)."""
    parallel = ParallelConfig(data_parallel_size=2)
    parallel.reconfigure_for_independent_dp_rank()
    assert parallel.data_parallel_size == 1
    make_scheduler(SequenceHookScheduler,
                   tiny_model_path,
                   False, {
                       "sync_token_id": hook_ids.sync,
                       "promise_token_id": hook_ids.promise
                   },
                   parallel_config=parallel)


def test_a_lockstep_engine_core_is_refused(tiny_model_path, hook_ids,
                                           monkeypatch):
    """A MoE model's engine cores keep the deployment's size (the tiny
    model given experts: no MoE checkpoint here)."""
    monkeypatch.setattr(ModelConfig, "get_num_experts", lambda self: 8)
    with pytest.raises(ValueError, match="data parallelism of MoE models"):
        make_scheduler(SequenceHookScheduler,
                       tiny_model_path,
                       False, {
                           "sync_token_id": hook_ids.sync,
                           "promise_token_id": hook_ids.promise
                       },
                       parallel_config=ParallelConfig(data_parallel_size=2))


def test_a_moe_model_is_refused_before_any_engine_core_starts(
        tiny_model_path, hook_ids, monkeypatch):
    """In the API process (`EngineArgs.create_engine_config`, as `vllm
    serve` calls it) a dense model's data parallelism passes and a MoE
    model's is refused."""
    engine_args = EngineArgs(model=str(tiny_model_path),
                             dtype="float32",
                             data_parallel_size=2,
                             special_kwargs={
                                 "sync_token_id": hook_ids.sync,
                                 "promise_token_id": hook_ids.promise
                             })
    assert engine_args.create_engine_config(
    ).parallel_config.data_parallel_size == 2
    monkeypatch.setattr(ModelConfig, "get_num_experts", lambda self: 8)
    with pytest.raises(ValueError, match="data parallelism of MoE models"):
        engine_args.create_engine_config()


def test_a_sample_without_its_siblings_is_logged():
    """Samples split over engines (no middleware, no router pin): the
    engine core that gets sample 1 but never saw sample 0 says so."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("vllm.sequence_hooks.transport")
    logger.addHandler(handler)
    try:
        trees = SampleTrees()
        trees.added("0_together")
        trees.added("1_together")
        trees.added("plain-request")
        assert records == []
        trees.added("1_split")
        [record] = records
        assert "none of its siblings" in record.getMessage()
        assert "split" in record.getMessage()
    finally:
        logger.removeHandler(handler)
