# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The logprobs the engine core keeps for tree nodes
(`vllm_sequence_hooks.member_logprobs`), model-free: rows as upstream's
sampler makes them (as wide as the batch's largest request asked),
read as upstream's frontend reads an output's, and a held root's output
rows rebuilt from its entries; on the real scheduler, nothing kept
outlives its member.
"""

import numpy as np
import pytest
from vllm_sequence_hooks.member_logprobs import (MemberLogprobs,
                                                 output_logprob_rows)
from vllm_sequence_hooks.scheduler import SequenceHookScheduler

from sequence_hooks_testkit.v1_batch_queue import (FILLER, BatchQueueDriver,
                                                   make_request,
                                                   make_scheduler)
from vllm import SamplingParams
from vllm.logprobs import Logprob, append_logprobs_for_next_position
from vllm.v1.outputs import LogprobsLists
from vllm.v1.request import Request

WIDTH = 6  # a batch whose largest request asked for 5


def request(**logprobs) -> Request:
    return Request(request_id="member",
                   prompt_token_ids=[1, 2, 3],
                   sampling_params=SamplingParams(max_tokens=8, **logprobs),
                   pooling_params=None)


def rows(sampled: list[int], ranks: list[int]) -> LogprobsLists:
    """One row per sampled token: it first, then the top tokens 100,
    101, ... (the sampled one among them where it ranks there)."""
    ids = np.zeros((len(sampled), WIDTH), dtype=np.int64)
    values = np.zeros((len(sampled), WIDTH), dtype=np.float32)
    for row, (token, rank) in enumerate(zip(sampled, ranks)):
        top = [100 + i for i in range(WIDTH - 1)]
        if rank < WIDTH:
            top[rank - 1] = token
        ids[row] = [token, *top]
        values[row] = [-0.5 * rank, *(-0.5 * (i + 1) for i in range(len(top)))]
    return LogprobsLists(ids, values, np.array(ranks, dtype=np.int64))


def frontend(new_logprobs: LogprobsLists, num_logprobs: int) -> list:
    """The entries upstream's frontend makes of an output's rows."""
    entries: list = []
    for ids, values, rank in zip(*new_logprobs[:3]):
        append_logprobs_for_next_position(entries, ids.tolist(),
                                          values.tolist(), [None] * len(ids),
                                          int(rank), num_logprobs)
    return entries


def entry(*columns: tuple[int, float, int]) -> dict:
    """A sampled token's entry as an output shows it, from its columns:
    (token, logprob, rank)."""
    return {token: Logprob(value, rank) for token, value, rank in columns}


# `rows([5, 6], [1, 9])` as a member that asked for a count reads them:
# the sampled token (5 ranks 1, its own top token; 6 ranks 9), then the
# top tokens 100 (-0.5), 101 (-1.0), 102 (-1.5)... up to the count.
FIVE, SIX = (5, -0.5, 1), (6, -4.5, 9)
TOP = [(100, -0.5, 1), (101, -1.0, 2), (102, -1.5, 3)]


@pytest.mark.parametrize("asked,expected", [
    pytest.param(dict(logprobs=0), [entry(FIVE), entry(SIX)], id="0"),
    pytest.param(dict(logprobs=1),
                 [entry(FIVE), entry(SIX, TOP[0])], id="1"),
    pytest.param(
        dict(logprobs=3),
        [entry(FIVE, *TOP[1:]), entry(SIX, *TOP)], id="3"),
    pytest.param(
        dict(logprob_token_ids=[7, 8]),
        [entry(FIVE, TOP[1]), entry(SIX, *TOP[:2])],
        id="token ids"),
])
def test_a_member_keeps_what_it_asked_for_not_the_batch_s(asked, expected):
    """As the frontend cuts an output's rows to the request's count."""
    kept = MemberLogprobs.of(request(**asked))
    kept.sampled(rows([5, 6], [1, 9]))
    assert kept.entries == expected


def test_a_member_that_asked_none_keeps_none():
    assert MemberLogprobs.of(request()) is None


@pytest.mark.parametrize("num_logprobs", [0, 2, 5])
def test_a_held_output_s_rows_give_the_frontend_the_kept_entries(num_logprobs):
    """Rebuilt rows, read as the frontend reads them, give back the same
    entries: the sampled token in the top ones and past them; a token
    with none gets the merged tokens' row."""
    step = rows([5, 6, 7], [1, 3, 9])
    entries = frontend(step, num_logprobs)
    tokens = [5, 6, 7, 8]
    got = output_logprob_rows(tokens, [*entries, None], num_logprobs)
    again = frontend(got, num_logprobs)
    assert again[:3] == entries
    assert {token: lp.logprob for token, lp in again[3].items()} == {8: 0.0}


def test_entries_missing_a_rank_fall_back_to_the_sampled_token():
    """Rows of repeated ids (a batch with ``logprob_token_ids``) collapse
    into fewer entries than ranks: no row is lost, none raises."""
    step = LogprobsLists(
        np.array([[5, 0, 0]]),
        np.array([[-1.0, -np.inf, -np.inf]], dtype=np.float32), np.array([4]))
    entries = frontend(step, 2)
    got = output_logprob_rows([5], entries, 2)
    assert got.logprob_token_ids[0, 0] == 5
    assert got.logprobs[0, 0] == -1.0
    assert frontend(got, 2)[0][5].logprob == -1.0


def test_a_child_that_ends_in_its_root_s_last_step_leaves_nothing_kept(
        tiny_model_path, hook_ids):
    """A root that ends (no `<sync>`) in the step its child ends, its
    output first: the child's output comes after its tree is gone, and
    what the engine core kept for it goes too (it stayed for good)."""
    scheduler = make_scheduler(SequenceHookScheduler,
                               tiny_model_path,
                               False,
                               special_kwargs={
                                   "sync_token_id": hook_ids.sync,
                                   "promise_token_id": hook_ids.promise,
                               })
    end = 6

    def sample(request_id: str, position: int) -> int:
        # A child's position p is sampled in the step of its root's p + 1.
        last = end - 1 if "/promise-" in request_id else end
        if position == last:
            return hook_ids.eos
        return hook_ids.promise if position == 0 else FILLER

    driver = BatchQueueDriver(scheduler, sample, depth=1)
    driver.add(
        make_request(scheduler,
                     "r0", [FILLER] * 8,
                     32,
                     hook_ids.eos,
                     logprobs=1))
    driver.run()
    # The root's end records its unfinished child aborted; the engine
    # core had finished it in the same step, so no abort is sent.
    [child] = driver.trees["r0"]["children"]
    assert child["finish_reason"] == "abort"
    assert scheduler.requests == {}
    assert len(scheduler.hooks.members) == 0
