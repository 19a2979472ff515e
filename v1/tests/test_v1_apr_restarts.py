# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""APR's restarted calls on the real V1 scheduler, model-free, with and
without async scheduling (the engine core's batch queue, as
`test_v1_async_scheduling` drives it).

A restarted call is a new request under its member's id. With a step of
the old call in flight, upstream would apply that step's token to the new
request; the new call therefore starts only once none is in flight. A
scripted search runs both ways: the same output, the root's held until
its end, and the scheduler left clean.
"""

import functools
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer
from vllm_sequence_hooks.scheduler import (AsyncSequenceHookScheduler,
                                           SequenceHookScheduler)

from sequence_hooks_testkit.formats.apr_scripts import (CHILD_1, CONCLUDES,
                                                        FAILS, GENERATED,
                                                        LISTED, ROOT, WINS)
from sequence_hooks_testkit.v1_batch_queue import (BatchQueueDriver,
                                                   make_request,
                                                   make_scheduler)
from sequence_hooks_testkit.v1_engines import computed_tokens
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.request import RequestStatus

# The APR toy's configuration and tokenizer (no weights are read).
MODEL = Path(__file__).resolve().parents[2] / "models" / "apr-toy"
TOKENIZER = AutoTokenizer.from_pretrained(MODEL)
EOS = TOKENIZER.eos_token_id
PROMPT = TOKENIZER.encode(TOKENIZER.bos_token + ROOT)
# How the root's call made anew at `<Calling Sub Searches>` goes on.
AFTER_CALLING = "\n" + LISTED
# The root writes `<Sub Searches>`: its call is made anew there, so what
# would follow is never sampled, unless a step in flight leaks into the new
# call.
WRITES_THE_TAG = GENERATED + "<Sub Searches>" + "never sampled"
# Each call's text by how its prompt ends: the root's first call, its call
# made anew, the two children, the root after their join.
SCRIPTS = {
    "Operations: []": WRITES_THE_TAG,
    "<Calling Sub Searches>": AFTER_CALLING,
    "Operations: ['51-49=2']": FAILS,
    "Operations: ['36-25=11']": WINS,
    "<End Sub Searches>\n": CONCLUDES,
}


def sampler(scheduler, scripts: dict[str, str]):
    """Each call writes its script, one token a position, then EOS (also
    for a step in flight past its end, as under async scheduling)."""
    tokens = {
        end: TOKENIZER.encode(text, add_special_tokens=False) + [EOS]
        for end, text in scripts.items()
    }

    def sample(request_id: str, position: int) -> int:
        request = scheduler.requests[request_id]
        prompt = TOKENIZER.decode(request.prompt_token_ids)
        [script] = [t for end, t in tokens.items() if prompt.endswith(end)]
        return script[min(position, len(script) - 1)]

    return sample


def searches(async_scheduling: bool,
             scripts: dict[str, str] = SCRIPTS,
             model: Path = MODEL,
             **config):
    """A scheduler that serves APR searches of ``scripts`` (``config``:
    `make_scheduler`'s); its driver."""
    scheduler = make_scheduler(SequenceHookScheduler,
                               model,
                               async_scheduling,
                               special_kwargs={"format": "apr"},
                               **{
                                   "max_model_len": 2048,
                                   **config
                               })
    driver = BatchQueueDriver(scheduler,
                              sampler(scheduler, scripts),
                              depth=2 if async_scheduling else 1)
    return scheduler, driver


def run(async_scheduling: bool, scripts: dict[str, str] = SCRIPTS):
    scheduler, driver = searches(async_scheduling, scripts)
    driver.add(make_request(scheduler, "r0", PROMPT, 400, EOS))
    with computed_tokens(scheduler) as log:
        driver.run()
    return scheduler, driver, log


@pytest.mark.parametrize("async_scheduling", [False, True],
                         ids=["sync", "async"])
def test_a_search_restarts_its_calls_cleanly(async_scheduling):
    scheduler, driver, log = run(async_scheduling)
    assert (type(scheduler) is AsyncSequenceHookScheduler) == async_scheduling
    # The root's output: once, at its end, the whole final trace.
    [(request_id, token_ids, reason)] = driver.outputs
    assert (request_id, reason) == ("r0", "stop")
    assert token_ids[-1] == EOS
    text = TOKENIZER.decode(token_ids[:-1])
    assert text == (GENERATED + "<Sub Searches>\n"
                    "<No Solution in Sub Search 0 at level 1 at Node #0,0>\n"
                    "<Goal Reached in Sub Search 1 at level 1 at Node #0,1>\n"
                    "51-11=40\n49-40=9 Goal Reached\n<End Sub Searches>\n" +
                    CONCLUDES.rstrip("\n"))
    tree = driver.trees["r0"]
    assert [c["label"] for c in tree["children"]] == ["#0,0", "#0,1"]
    # Three calls of the root (the rewrite, the call, the join), one of
    # each child: each starts with a prefill of its prompt.
    prefills = [r for r, n in log if n > 1]
    assert sorted(prefills) == ["r0"] * 3 + ["r0/promise-0", "r0/promise-1"]
    assert_clean(scheduler)


def assert_clean(scheduler) -> None:
    assert scheduler.requests == {}
    assert scheduler.hooks.coordinator.num_members() == 0
    # No record: no call made anew waiting, no template, no logprobs.
    assert len(scheduler.hooks.members) == 0
    assert len(scheduler.hooks.members.sample_trees) == 0
    assert scheduler.num_waiting_for_streaming_input == 0
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_async_and_sync_give_the_same_search():
    _, sync_run, _ = run(False)
    _, async_run, _ = run(True)
    assert async_run.outputs == sync_run.outputs
    assert async_run.overlapped > 0


# Calls APR's controller answers without children: one that lists none
# (joined at once: a restart right after the call's end, with its next
# step in flight under async scheduling) and one whose node the trace
# does not describe (the search ends there, as the reference's `except`).
NO_CHILD = "<Calling Sub Searches>\n<End Calling Sub Searches>\n"
UNKNOWN_NODE = ("<Calling Sub Searches>\n<Start Sub Search 0 at level 1> "
                "Moving to Node #0,7\n<End Calling Sub Searches>\n")


@pytest.mark.parametrize("async_scheduling", [False, True],
                         ids=["sync", "async"])
@pytest.mark.parametrize("call,expected", [
    (NO_CHILD, GENERATED + "<Sub Searches>\n<End Sub Searches>\n" +
     CONCLUDES.rstrip("\n")),
    (UNKNOWN_NODE, GENERATED + UNKNOWN_NODE.rstrip("\n")),
],
                         ids=["no child", "unknown node"])
def test_a_call_without_children_ends_as_the_controller_answers_it(
        async_scheduling, call, expected):
    scheduler, driver, _ = run(async_scheduling, {
        "Operations: []": GENERATED + call,
        "<End Sub Searches>\n": CONCLUDES
    })
    [(request_id, token_ids, reason)] = driver.outputs
    assert (request_id, reason) == ("r0", "stop")
    assert token_ids[-1] == EOS
    assert TOKENIZER.decode(token_ids[:-1]) == expected
    assert not driver.trees["r0"]["children"]
    assert_clean(scheduler)


@functools.cache
def alone_output(async_scheduling: bool) -> list:
    """The engine's outputs for the scripted search run alone."""
    _, driver, _ = run(async_scheduling)
    return driver.outputs


def own_tokens(scheduler, request_id: str, prompt_end: str) -> int:
    """Tokens the request's current call has sampled, if its prompt ends
    with ``prompt_end`` (else -1)."""
    request = scheduler.requests.get(request_id)
    if request is None or not TOKENIZER.decode(
            request.prompt_token_ids).endswith(prompt_end):
        return -1
    return request.num_output_tokens


def waits_for_its_old_call(scheduler, member_id: str) -> bool:
    """Whether a member's call made anew waits for its old call's steps
    in flight."""
    record = scheduler.hooks.members.get(member_id)
    return record is not None and record.new_call is not None


# Where a search is aborted from outside (its client gone), by what the
# scheduler holds after a step. The old call's step in flight while its
# call made anew waits is an async scheduling state only.
STAGES = {
    "first call":
    lambda s: own_tokens(s, "r0", "Operations: []") >= 3,
    "call made anew, old step in flight":
    lambda s: waits_for_its_old_call(s, "r0"),
    "call made anew":
    lambda s: own_tokens(s, "r0", "<Calling Sub Searches>") >= 1,
    "sub-searches running":
    lambda s: own_tokens(s, "r0/promise-1", CHILD_1) >= 3,
    "one sub-search ended":
    lambda s: "r0/promise-0" not in s.requests and own_tokens(
        s, "r0/promise-1", CHILD_1) > len(
            TOKENIZER.encode(FAILS, add_special_tokens=False)) + 1,
    "after the join":
    lambda s: own_tokens(s, "r0", "<End Sub Searches>\n") >= 2,
}
CASES = [(stage, async_scheduling) for stage in STAGES
         for async_scheduling in (False, True)
         if async_scheduling or "in flight" not in stage]


@pytest.mark.parametrize("everything", [False, True], ids=["one", "all"])
@pytest.mark.parametrize(
    "stage,async_scheduling",
    CASES,
    ids=[f"{stage}-{'async' if a else 'sync'}" for stage, a in CASES])
def test_an_aborted_search_leaves_nothing_and_the_next_runs_as_alone(
        stage, async_scheduling, everything):
    """The engine core's abort (`finish_requests`, FINISHED_ABORTED) at
    each point of a search, of its request or of all (a pause that
    aborts, the engine's fault handling): no output, nothing held, and
    the next search gives what it gives alone."""
    scheduler, driver = searches(async_scheduling)
    driver.add(make_request(scheduler, "r0", PROMPT, 400, EOS))
    driver.run_until(STAGES[stage], stage)
    if everything:
        aborted = scheduler.finish_requests(None,
                                            RequestStatus.FINISHED_ABORTED)
        # The engine core sends each an abort output: its client hears.
        assert [request.request_id for request in aborted] == ["r0"]
        driver.run()
    else:
        driver.abort("r0")
    assert driver.outputs == [] and driver.trees == {}
    assert_clean(scheduler)
    driver.add(make_request(scheduler, "r1", PROMPT, 400, EOS))
    driver.run()
    [(request_id, token_ids, reason)] = driver.outputs
    [(_, *alone)] = alone_output(async_scheduling)
    assert (request_id, [token_ids, reason]) == ("r1", alone)
    assert [c["label"]
            for c in driver.trees["r1"]["children"]] == ["#0,0", "#0,1"]
    assert_clean(scheduler)


@pytest.fixture(scope="module")
def calling_in_characters(tmp_path_factory) -> Path:
    """The toy's configuration with ``<Calling Sub Searches>`` in
    characters (its id renamed): the controller's rewrite is longer than
    the `<Sub Searches>` it replaces."""
    folder = tmp_path_factory.mktemp("apr-calling-in-characters")
    for name in ("config.json", "generation_config.json",
                 "special_tokens_map.json", "tokenizer_config.json",
                 "tokenizer.json"):
        text = (MODEL / name).read_text()
        (folder / name).write_text(
            text.replace('"<Calling Sub Searches>"', '"<Unused>"'))
    return folder


@pytest.mark.parametrize("async_scheduling", [False, True],
                         ids=["sync", "async"])
def test_a_rewrite_past_the_window_ends_the_root_and_its_call(
        calling_in_characters, async_scheduling):
    """The root writes `<Sub Searches>` with room left in the window, but
    its call made anew would not fit: its output ends there, "length",
    once; its call ends with it (no later token, nothing kept)."""
    split = AutoTokenizer.from_pretrained(calling_in_characters)
    generated = TOKENIZER.encode(GENERATED, add_special_tokens=False)
    at_tag = len(PROMPT) + len(generated) + 1
    assert len(
        split.encode(split.bos_token + ROOT + GENERATED +
                     "<Calling Sub Searches>")) > at_tag + 3
    scheduler, driver = searches(async_scheduling,
                                 model=calling_in_characters,
                                 max_model_len=at_tag + 3)
    driver.add(make_request(scheduler, "r0", PROMPT, 400, EOS, logprobs=1))
    with computed_tokens(scheduler) as log:
        driver.run()
    [(request_id, token_ids, reason)] = driver.outputs
    assert (request_id, reason) == ("r0", "length")
    assert TOKENIZER.decode(token_ids) == GENERATED + "<Calling Sub Searches>"
    # One step per token to the tag, and one in flight past it.
    assert len([r for r, _ in log]) <= len(generated) + 1 + async_scheduling
    assert_clean(scheduler)


@pytest.mark.parametrize("async_scheduling", [False, True],
                         ids=["sync", "async"])
def test_roots_waiting_for_sub_searches_take_no_row_and_no_extra_one(
        async_scheduling):
    """Three searches, two rows (`max_num_seqs`): a root waiting for its
    sub-searches holds no request, so it is not uncounted as a parked
    session (the running queue passed the limit and upstream's assert
    took the engine core down); each answers as alone."""
    scheduler, driver = searches(async_scheduling, max_num_seqs=2)
    for request_id in ("r0", "r1", "r2"):
        driver.add(make_request(scheduler, request_id, PROMPT, 400, EOS))
    with computed_tokens(scheduler) as log:
        driver.run()
    [(_, *alone)] = alone_output(async_scheduling)
    assert sorted(driver.outputs) == [(r, *alone) for r in ("r0", "r1", "r2")]
    assert "r2/promise-1" in {request_id for request_id, _ in log}
    assert_clean(scheduler)


def test_the_samples_of_a_search_leave_no_sample_record():
    """`n = 2` (the frontend's sample ids): each answers as alone; a
    sub-search is no sample (its id has the form)."""
    scheduler, driver = searches(False)
    for request_id in ("0_s", "1_s"):
        driver.add(make_request(scheduler, request_id, PROMPT, 400, EOS))
    driver.run()
    [(_, *alone)] = alone_output(False)
    assert sorted(driver.outputs) == [("0_s", *alone), ("1_s", *alone)]
    assert_clean(scheduler)


def prompt_scores(runner_output, request, count: int) -> None:
    """Adds to ``runner_output`` what a model runner gives for a step that
    computed ``count`` of ``request``'s positions: with the step that ends
    its prefill, its prompt's logprobs, whole (a row per position but the
    last: the logprob of the token after it, -(position + 1) / 1000, rank
    1), and its scores of `prompt_logprob_token_ids` (the same values),
    as asked."""
    prompt, end = request.prompt_token_ids, request.num_computed_tokens
    if not end - count < len(prompt) <= end:
        return
    rows = range(len(prompt) - 1)
    values = torch.tensor([[-(p + 1) / 1000] * 2 for p in rows])
    params, request_id = request.sampling_params, request.request_id
    if params.prompt_logprobs is not None:
        runner_output.prompt_logprobs_dict[request_id] = LogprobsTensors(
            torch.tensor([[prompt[p + 1]] * 2 for p in rows]), values,
            torch.tensor([1] * len(rows)))
    if params.prompt_logprob_token_ids is not None:
        runner_output.prompt_token_id_logprobs_dict[request_id] = values


def test_a_search_s_prompt_logprobs_come_with_its_answer():
    """The root's prompt logprobs (both kinds) come with its first call's
    first output, held back: they go with its answer (without them the
    frontend gave `[None]`, and completions with `echo` and `logprobs` a
    500). Its later calls ask none, and read the prefix cache: they
    compute what they compute without them."""
    scheduler, driver = searches(False)
    update, ended = scheduler.update_from_output, []

    def with_prompt_logprobs(output, runner_output):
        for request_id, count in output.num_scheduled_tokens.items():
            prompt_scores(runner_output, scheduler.requests[request_id], count)
        outputs = update(output, runner_output)
        ended.extend(out for batch in outputs.values() for out in batch.outputs
                     if out.finish_reason is not None)
        return outputs

    scheduler.update_from_output = with_prompt_logprobs
    driver.add(
        make_request(scheduler,
                     "r0",
                     PROMPT,
                     400,
                     EOS,
                     prompt_logprobs=1,
                     prompt_logprob_token_ids=[[7, 8]] * (len(PROMPT) - 1)))
    with computed_tokens(scheduler) as log:
        driver.run()
    [(_, token_ids, _)] = driver.outputs
    _, alone, alone_log = run(False)
    assert token_ids == alone.outputs[0][1]
    assert sorted(log) == sorted(alone_log)
    [out] = ended
    expected = [-(p + 1) / 1000 for p in range(len(PROMPT) - 1)]
    rows = out.new_prompt_logprobs_tensors
    assert rows.logprob_token_ids[:, 0].tolist() == PROMPT[1:]
    assert rows.logprobs[:, 0].tolist() == pytest.approx(expected)
    assert out.prompt_token_id_logprobs[:,
                                        0].tolist() == pytest.approx(expected)
    assert_clean(scheduler)


@pytest.mark.parametrize("async_scheduling", [False, True],
                         ids=["sync", "async"])
def test_a_sub_search_ended_with_an_error_has_no_solution(async_scheduling):
    """Upstream ends a sub-search with an error (here a lost encoder
    input; a KV load that failed is the same path) while its root holds
    no request: the error's output is its end, "error" in the tree, and
    the search goes on with it as a call with no solution."""
    scheduler, driver = searches(async_scheduling)
    driver.add(make_request(scheduler, "r0", PROMPT, 400, EOS))
    stage = "sub-searches running"
    driver.run_until(STAGES[stage], stage)
    assert "r0" not in scheduler.requests
    scheduler.encoder_cache_mismatch_reqs.add("r0/promise-1")
    driver.run()
    [(request_id, token_ids, reason)] = driver.outputs
    assert (request_id, reason) == ("r0", "stop")
    assert "<No Solution in Sub Search 1 at level 1 at Node #0,1>" in (
        TOKENIZER.decode(token_ids))
    assert [c["finish_reason"]
            for c in driver.trees["r0"]["children"]] == ["stop", "error"]
    assert_clean(scheduler)
