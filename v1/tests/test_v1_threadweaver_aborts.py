# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ThreadWeaver's fork and join on the real V1 scheduler, model-free, with
and without async scheduling, and its tree aborted from outside (the
client gone) at each point of its lifecycle: no output, nothing held (no
request, member, parked parent, pending call or KV block), and the next
request answers as it does alone.

One scripted answer: the root outlines two threads; the threads write
their scripts (the second is longer, so it runs on alone); the root goes
on after the join. Seeded, the root's call after the join is made anew
(the controller seeds every call): a new request under its id.
"""

import functools

import pytest
from vllm_sequence_hooks.scheduler import SequenceHookScheduler

from sequence_hooks_testkit.formats.threadweaver_toy import (CLOSE_THREAD, EOS,
                                                             MODEL,
                                                             OPEN_THREAD,
                                                             PROMPT, TOKENIZER)
from sequence_hooks_testkit.v1_batch_queue import (BatchQueueDriver,
                                                   fork_stages, make_request,
                                                   make_scheduler)

ROOT = ("<Think>1<Parallel>\n<Outlines>\n<Outline>1: a</Outline>\n"
        "<Outline>2: b</Outline>\n</Outlines>")
THREADS = [" 3 4</Thread>", " 5 6 7 8 9 1 2 3 4 5 6 7 8</Thread>"]
AFTER_JOIN = "</Parallel>\n<Conclusion>9</Conclusion>"
# What the join adds after the last thread (no thread hit EOS or length).
JOIN_SUFFIX = len(TOKENIZER.encode("\n", add_special_tokens=False))


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False) + [EOS]


def sample(scheduler):
    """Greedy scripts, one token a position, EOS past their end: a thread
    writes its own after its header, the root its outlines, then, once
    its context holds the join, what follows it."""
    root, after_join = ids(ROOT), ids(AFTER_JOIN)
    threads = [ids(text) for text in THREADS]

    def next_token(request_id: str, position: int) -> int:
        request = scheduler.requests[request_id]
        context = request.all_token_ids
        # The index the sampled token takes (in-flight steps included).
        at = request.num_computed_tokens
        if "/promise-" in request_id:
            opened = len(context) - context[::-1].index(OPEN_THREAD) - 1
            header_end = context.index(TOKENIZER.convert_tokens_to_ids(":"),
                                       opened) + 1
            script = threads[int(request_id.rsplit("-", 1)[1])]
            index = at - header_end
        elif CLOSE_THREAD in context:
            closed = len(context) - context[::-1].index(CLOSE_THREAD) - 1
            script, index = after_join, at - (closed + 1 + JOIN_SUFFIX)
        else:
            script, index = root, at - len(PROMPT)
        return script[min(index, len(script) - 1)]

    return next_token


def answers(async_scheduling: bool, sampler=sample, **config):
    """A scheduler serving the scripted answer (``sampler`` of it, as
    `sample`; ``config``: `make_scheduler`'s); its driver."""
    scheduler = make_scheduler(SequenceHookScheduler,
                               MODEL,
                               async_scheduling,
                               special_kwargs={"format": "threadweaver"},
                               **config)
    driver = BatchQueueDriver(scheduler,
                              sampler(scheduler),
                              depth=2 if async_scheduling else 1)
    return scheduler, driver


def request(scheduler, request_id: str, seeded: bool):
    return make_request(scheduler, request_id, PROMPT, 200, EOS,
                        **({
                            "seed": 7
                        } if seeded else {}))


def assert_clean(scheduler) -> None:
    assert scheduler.requests == {}
    assert scheduler.hooks.coordinator.num_members() == 0
    # No record: no call made anew waiting, no template.
    assert len(scheduler.hooks.members) == 0
    assert scheduler.hooks.coordinator.num_parked() == 0
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


@functools.cache
def alone(async_scheduling: bool, seeded: bool) -> tuple:
    """The scripted answer run alone: its output, tree and the requests
    the scheduler was given (by id)."""
    scheduler, driver = answers(async_scheduling)
    added, add = [], scheduler.add_request
    scheduler.add_request = lambda r: add(r) or added.append(r.request_id)
    driver.add(request(scheduler, "r0", seeded))
    driver.run()
    assert_clean(scheduler)
    return driver.outputs, driver.trees["r0"], added


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
@pytest.mark.parametrize("async_scheduling", [False, True],
                         ids=["sync", "async"])
def test_threads_join_into_the_answer_and_leave_nothing(
        async_scheduling, seeded):
    outputs, tree, added = alone(async_scheduling, seeded)
    # Seeded, the root's call after the join is a request of its own.
    assert added.count("r0") == 1 + seeded
    token_ids = [t for _, new, _ in outputs for t in new]
    assert outputs[-1][2] == "stop" and token_ids[-1] == EOS
    assert TOKENIZER.decode(
        token_ids[:-1]) == (ROOT + "\n<Thread>\n1:" + THREADS[0] +
                            "<Thread>\n2:" + THREADS[1] + "\n" + AFTER_JOIN)
    assert [c["label"] for c in tree["children"]] == ["1", "2"]


def threads(tree: dict) -> list:
    """Each thread's label and tokens."""
    return [(c["label"], c["token_ids"]) for c in tree["children"]]


def after_join(scheduler) -> int:
    """Tokens the root sampled after the join (-1 before it)."""
    request = scheduler.requests.get("r0")
    if request is None or CLOSE_THREAD not in request.all_token_ids:
        return -1
    context = request.all_token_ids
    return len(context) - 1 - context[::-1].index(CLOSE_THREAD) - JOIN_SUFFIX


# Where the answer is aborted, by what the scheduler holds after a step.
# (A seeded root's call after the join never waits for a step in flight:
# the root was parked, so none is.)
STAGES = {
    **fork_stages("the outlines", "thread",
                  len(ids(THREADS[0])) + 1),
    "after the join":
    lambda s: after_join(s) >= 2,
}
CASES = [(stage, a, seeded) for stage in STAGES for a in (False, True)
         for seeded in (False, True) if "waits" not in stage or (a and seeded)]


@pytest.mark.parametrize("stage,async_scheduling,seeded",
                         CASES,
                         ids=[
                             f"{stage}-{'async' if a else 'sync'}"
                             f"-{'seeded' if seeded else 'unseeded'}"
                             for stage, a, seeded in CASES
                         ])
def test_an_aborted_answer_leaves_nothing_and_the_next_runs_as_alone(
        stage, async_scheduling, seeded):
    """The engine core's abort (`finish_requests`, FINISHED_ABORTED) at
    each point of the answer."""
    scheduler, driver = answers(async_scheduling)
    driver.add(request(scheduler, "r0", seeded))
    driver.run_until(STAGES[stage], stage)
    driver.abort("r0")
    assert driver.trees == {}
    assert all(reason is None for _, _, reason in driver.outputs)
    assert_clean(scheduler)
    given = len(driver.outputs)
    driver.add(request(scheduler, "r1", seeded))
    driver.run()
    outputs, tree, _ = alone(async_scheduling, seeded)
    assert driver.outputs[given:] == [("r1", new, reason)
                                      for _, new, reason in outputs]
    assert threads(driver.trees["r1"]) == threads(tree)
    assert_clean(scheduler)


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
@pytest.mark.parametrize("async_scheduling", [False, True],
                         ids=["sync", "async"])
def test_outlines_with_no_room_for_a_thread_fork_none(async_scheduling,
                                                      seeded):
    """The outlines close where a thread's header leaves no token to
    sample: no thread forks (its prefill would pass the window, with a
    budget below one: the engine core died of it), and the answer goes
    on, here to its EOS."""
    header = TOKENIZER.encode("\n<Thread>\n1:", add_special_tokens=False)
    window = len(PROMPT) + len(ids(ROOT)) - 1 + len(header)
    scheduler, driver = answers(async_scheduling, max_model_len=window)
    driver.add(request(scheduler, "r0", seeded))
    driver.run()
    assert [t for _, new, _ in driver.outputs for t in new] == ids(ROOT)
    assert driver.outputs[-1][2] == "stop"
    assert driver.trees["r0"]["children"] == []
    assert_clean(scheduler)


# Outlines with no label: a seeded root's next call is made anew at once.
NO_LABEL = ("<Think>1<Parallel>\n<Outlines>\n<Outline>a: x</Outline>\n"
            "</Outlines> 3 4 5 6 7")


def no_label(scheduler):
    """Greedy ``NO_LABEL``, one token a position, then EOS."""
    script = ids(NO_LABEL)

    def next_token(request_id: str, position: int) -> int:
        # The index the sampled token takes (in-flight steps included).
        at = scheduler.requests[request_id].num_computed_tokens
        return script[min(at - len(PROMPT), len(script) - 1)]

    return next_token


def test_a_call_made_anew_at_the_first_outlines_waits_for_its_step():
    """With async scheduling the step after the outlines is in flight when
    they come back, scheduled before the tree began: the new call waits
    for it as for any other, and the answer is the same as without."""
    drivers = []
    for async_scheduling in (False, True):
        scheduler, driver = answers(async_scheduling, no_label)
        driver.add(request(scheduler, "r0", seeded=True))
        driver.run()
        assert_clean(scheduler)
        drivers.append(driver)
    sync, overlapped = drivers
    assert overlapped.outputs == sync.outputs and overlapped.overlapped > 0
    assert [t for _, new, _ in sync.outputs for t in new] == ids(NO_LABEL)


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
def test_a_call_ended_at_a_stop_id_of_the_requests_goes_on_as_a_new_call(
        seeded):
    """The request's own stop id ``:`` ends the root's call twice in its
    outlines: each time the next call is a new request under its id (the
    controller's next call), which with async scheduling waits for the
    step in flight; the answer is the one without the stop, the stop ids
    among its tokens, and nothing is left."""
    colon = TOKENIZER.convert_tokens_to_ids(":")
    plain, _, plain_added = alone(False, seeded)
    runs = []
    for async_scheduling in (False, True):
        scheduler, driver = answers(async_scheduling)
        added, add = [], scheduler.add_request
        scheduler.add_request = lambda r, add=add, added=added: add(
            r) or added.append(r.request_id)
        driver.add(
            make_request(scheduler,
                         "r0",
                         PROMPT,
                         200,
                         EOS,
                         stop_token_ids=[colon],
                         **({
                             "seed": 7
                         } if seeded else {})))
        driver.run()
        assert_clean(scheduler)
        token_ids = [t for _, new, _ in driver.outputs for t in new]
        assert token_ids == [t for _, new, _ in plain for t in new]
        # The outlines' two labels: two more calls than without.
        assert added.count("r0") == plain_added.count("r0") + 2
        assert [c["label"]
                for c in driver.trees["r0"]["children"]] == ["1", "2"]
        runs.append(driver)
    sync, overlapped = runs
    assert overlapped.outputs == sync.outputs and overlapped.overlapped > 0
