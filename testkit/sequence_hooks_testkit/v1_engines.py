# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The V1 test engines (stock vLLM 0.32 with the plugin) and their checks:
the V1 `Flavour` of `conformance`.

Import only in the V1 environment (`.venv-v1`).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from sequence_hooks_testkit.conformance import Flavour
from sequence_hooks_testkit.tiny_model import SPECIAL_TOKENS
from sequence_hooks_testkit.v1_scripted_logits import SCRIPT_KEY, make_script

# Never chosen on a free step: the hook tokens, EOS and the other specials.
MASKED_IDS = range(len(SPECIAL_TOKENS))


def v1_llm(model_path: Path, hook_ids=None, **engine_kwargs):
    """A V1 `LLM` over the tiny model (fp32, eager), hooked if ids given.

    Args:
        model_path: The tiny model's folder.
        hook_ids: `HookIds` to turn the hooks on (role marker included).
        engine_kwargs: Overrides of the engine arguments.
    """
    # The plugin imported first: `special_kwargs=` (`engine_args`).
    import vllm_sequence_hooks  # noqa: F401

    from sequence_hooks_testkit.v1_scripted_logits import (RandomHooksV1,
                                                           ScriptedHooksV1)
    from vllm import LLM
    if hook_ids is not None:
        engine_kwargs["special_kwargs"] = {
            "sync_token_id": hook_ids.sync,
            "promise_token_id": hook_ids.promise,
            "child_role_token_id": hook_ids.child,
        }
    return LLM(
        model=str(model_path),
        **{
            "max_model_len":
            256,
            "enforce_eager":
            True,
            "dtype":
            "float32",
            "seed":
            0,
            **engine_kwargs,
            # The scripts (the hooks add their request check).
            "logits_processors": [
                *engine_kwargs.get("logits_processors", ()), ScriptedHooksV1,
                RandomHooksV1
            ],
        })


def scripted_params(plans, ids, max_tokens: int = 64, **fixed):
    """Greedy SamplingParams that run ``plans`` on a hooked V1 engine: V1
    takes no per-request callables, so the script rides in `extra_args`
    for `ScriptedHooksV1`.

    Args:
        plans: Tokens per role path (see `scripted_hooks.ScriptedHooks`).
        ids: The tiny tokenizer's hook token ids.
        max_tokens: The request's budget.
        fixed: `role` and `step` of a fixed-role script (the reference).
    """
    from vllm import SamplingParams
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        extra_args={SCRIPT_KEY: make_script(plans, ids, MASKED_IDS, **fixed)})


def scheduler_of(llm):
    """The engine core's scheduler (in-process engine core)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


@contextmanager
def computed_tokens(scheduler: Any) -> Iterator[list[tuple[str, int]]]:
    """Records what each request computes in each step ``scheduler``
    schedules while the context is open.

    Args:
        scheduler: A V1 scheduler (`scheduler_of`, or one made model-free).

    Yields:
        The record, growing step by step as they are scheduled: (request
        id, tokens scheduled) for each request of each step.
    """
    log: list[tuple[str, int]] = []
    schedule = scheduler.schedule

    def recorded(*args, **kwargs):
        output = schedule(*args, **kwargs)
        log.extend(output.num_scheduled_tokens.items())
        return output

    scheduler.schedule = recorded
    try:
        yield log
    finally:
        del scheduler.schedule


def preempted_requests(scheduler: Any, monkeypatch) -> list[str]:
    """Records each request ``scheduler`` preempts until ``monkeypatch``
    undoes it.

    Args:
        scheduler: A V1 scheduler (`scheduler_of`, or one made model-free).
        monkeypatch: The test's `pytest.MonkeyPatch`.

    Returns:
        The record, growing as they are preempted: their ids, in order.
    """
    preempted: list[str] = []
    preempt = scheduler._preempt_request

    def recorded(request, *args, **kwargs):
        preempted.append(request.request_id)
        return preempt(request, *args, **kwargs)

    monkeypatch.setattr(scheduler, "_preempt_request", recorded)
    return preempted


def run_to_the_end(engine,
                   max_steps: int,
                   before_step: Callable[[], None] = lambda: None):
    """Steps ``engine`` until it has no unfinished request.

    Args:
        engine: An `LLMEngine` with requests added.
        max_steps: Steps after which it fails: nothing may run forever.
        before_step: Called before each step (e.g. to abort requests).

    Returns:
        The ids of the finished outputs, in order, and the ids of every
        output.
    """
    finished, output_ids = [], set()
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished, output_ids
        before_step()
        for output in engine.step():
            output_ids.add(output.request_id)
            if output.finished:
                finished.append(output.request_id)
    raise AssertionError(f"not done after {max_steps} steps")


def assert_engine_clean(llm):
    """Nothing left behind: no request, tree, parked session, pending fork,
    stop-string check or used KV block."""
    scheduler = scheduler_of(llm)
    pool = scheduler.kv_cache_manager.block_pool
    assert not llm.llm_engine.has_unfinished_requests()
    assert scheduler.requests == {}, {
        k: (r.status, r.num_tokens, r.num_computed_tokens)
        for k, r in scheduler.requests.items()
    }
    assert scheduler.hooks.coordinator.num_members() == 0
    # The records of the trees' requests (pending forks, evictions, kept
    # logprobs, held preemptions, stop-string checks) and what is kept
    # beside them.
    assert len(scheduler.hooks.members) == 0
    assert len(scheduler.hooks.members.sample_trees) == 0
    assert len(scheduler.hooks.members.in_flight) == 0
    assert scheduler.num_waiting_for_streaming_input == 0
    # Every block but the pool's reserved null block is free.
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def _promise_tree(output, completion=None):
    from vllm_sequence_hooks import promise_tree
    return promise_tree(output, completion)


# The checks of `conformance` on the V1 engine.
V1 = Flavour(scripted_params=scripted_params,
             promise_tree=_promise_tree,
             sample_tree=_promise_tree,
             assert_engine_clean=assert_engine_clean)
