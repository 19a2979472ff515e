# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The client-side join, the benchmarks' peer, equals the hooks.

For greedy scripted programs on the tiny model, a client running the join
on a stock engine gets the hooked engine's final text, token ids, finish
reason and tree, token for token: in-process (a stock `LLMEngine`) and
over HTTP (a stock `vllm serve` against a hooked one), with room to spare
and with budgets that cut children and merges. What it sent (requests,
prompt tokens) is what the hooked tree implies a client must send.
"""

import asyncio

import pytest

from sequence_hooks.special_kwargs import SpecialKwargs
from sequence_hooks_references.client_join import run_joins, scripted_options
from sequence_hooks_references.client_join_http import (HttpSender,
                                                        client_session,
                                                        run_join,
                                                        server_max_model_len,
                                                        stream_completion)
from sequence_hooks_testkit.engines import run_hooked, tiny_llm
from sequence_hooks_testkit.programs import NONE, PROMPTS, programs
from sequence_hooks_testkit.server import running_server, scripted_request_body

# The shared servers its tests use (conftest's `shared_servers`).
pytestmark = pytest.mark.shares("hooked")

# Room to spare, and a budget that cuts children and merges.
BUDGETS = [64, 6]
# The stock engine gets the scheduling options the hooks turn on: chunked
# prefill lets a child request's prefill share a step with its parent's
# decode, as a hooked child's first chunk does, so both sides interleave
# alike (which child finishes before its parent does depends on it).
STOCK_OPTIONS = {
    "enable_chunked_prefill": True,
    "disable_async_output_proc": True,
    "enable_prefix_caching": True,
}
STOCK_SERVER_OPTIONS = [
    "--enable-chunked-prefill", "--disable-async-output-proc",
    "--enable-prefix-caching"
]


def join_programs(ids) -> dict:
    """The named programs, and two that reach the hooks' other rules."""
    P, S = ids.promise, ids.sync
    return {
        **programs(ids),
        # The parent ends while its child runs: the child is aborted.
        "parent ends first": {
            (): [NONE, P, NONE],
            (0, ): [NONE] * 12,
        },
        # The grandchild's promise is past max_depth (2): an ordinary
        # token, and so is its <sync>, with nothing to join.
        "promise past the depth limit": {
            (): [P, S, NONE],
            (0, ): [P, S, NONE],
            (0, 0): [P, S, NONE],
        },
    }


def hooks_of(hook_ids) -> SpecialKwargs:
    """The hooked engines' configuration (kit defaults), as ids."""
    return SpecialKwargs(sync_token_id=hook_ids.sync,
                         promise_token_id=hook_ids.promise,
                         child_role_token_id=hook_ids.child)


def expected_traffic(output, sync: int) -> tuple[int, int]:
    """Requests and prompt tokens a client needs for a hooked output.

    One request per segment: a sequence's first, and one after each
    `<sync>` that did not end it, whose prompt is the context, the tokens
    up to the `<sync>` and what its merge appended.
    """
    tree = output.promise_tree
    return segments(list(output.outputs[0].token_ids),
                    () if tree is None else tree.merged_spans,
                    () if tree is None else tree.children,
                    len(output.prompt_token_ids), sync)


def segments(token_ids, merged_spans, children, context_len: int,
             sync: int) -> tuple[int, int]:
    """`expected_traffic` of one sequence and its subtree."""
    merged = dict(merged_spans)
    starts = [0] + [
        i + 1 + merged.get(i + 1, 0)
        for i, token_id in enumerate(token_ids[:-1]) if token_id == sync
    ]
    requests = len(starts)
    prompt_tokens = sum(context_len + start for start in starts)
    for child in children:
        child_requests, child_tokens = segments(
            child.token_ids, child.merged_spans, child.children,
            context_len + child.fork_position + 1, sync)
        requests += child_requests
        prompt_tokens += child_tokens
    return requests, prompt_tokens


def assert_same_tree(joined, hooked, exact_aborts: bool = True) -> None:
    """The join's tree is the hooked engine's, node for node (the hooked
    engine has none for a sequence that never promised).

    Over HTTP (``exact_aborts`` False) a child cancelled because its parent
    ended has written as many tokens as the server ran it for before the
    cancel arrived, which timing decides: its tokens and text need only be
    a prefix of the hooked child's, or the hooked child's of its own. The
    join's child starts only when its client reads the promise, so it can
    be cancelled (even before its first token) where the hooked child,
    run in its parent's steps, had finished.
    """
    if hooked is None:
        assert joined.children == ()
        return
    if not exact_aborts and "abort" in (hooked.finish_reason,
                                        joined.finish_reason):
        assert joined.finish_reason == "abort"
        assert joined.fork_position == hooked.fork_position
        shorter = min(len(joined.token_ids), len(hooked.token_ids))
        assert joined.token_ids[:shorter] == hooked.token_ids[:shorter]
        assert (joined.text.startswith(hooked.text)
                or hooked.text.startswith(joined.text))
        return
    assert joined.token_ids == hooked.token_ids
    assert joined.text == hooked.text
    assert joined.finish_reason == hooked.finish_reason
    assert joined.fork_position == hooked.fork_position
    assert joined.merged_spans == hooked.merged_spans
    assert len(joined.children) == len(hooked.children)
    for joined_child, hooked_child in zip(joined.children, hooked.children):
        assert_same_tree(joined_child, hooked_child, exact_aborts)


def cases(hook_ids):
    """(name, program, prompt) of every program, prompts cycled."""
    return [(name, program, PROMPTS[i % len(PROMPTS)])
            for i, (name,
                    program) in enumerate(join_programs(hook_ids).items())]


@pytest.fixture(scope="module")
def stock_llm(tiny_model_path):
    """A stock engine for the join, with prefix caching."""
    return tiny_llm(tiny_model_path, **STOCK_OPTIONS)


@pytest.mark.parametrize("max_tokens", BUDGETS)
def test_in_process_join_equals_hooks(hooked_llm, stock_llm, hook_ids,
                                      max_tokens):
    all_cases = cases(hook_ids)
    hooked = run_hooked(hooked_llm, hook_ids, [c[2] for c in all_cases],
                        [c[1] for c in all_cases], max_tokens)
    tokenizer = stock_llm.get_tokenizer()
    joined = run_joins(stock_llm.llm_engine,
                       [tokenizer.encode(c[2]) for c in all_cases],
                       max_tokens,
                       hooks_of(hook_ids),
                       [scripted_options(c[1], hook_ids) for c in all_cases],
                       defaults={"temperature": 0.0})
    for (name, _, _), output, result in zip(all_cases, hooked, joined):
        completion = output.outputs[0]
        assert result.token_ids == list(completion.token_ids), name
        assert result.text == completion.text, name
        assert result.finish_reason == completion.finish_reason, name
        assert_same_tree(result.promise_tree, output.promise_tree)
        assert (result.requests, result.prompt_tokens) == expected_traffic(
            output, hook_ids.sync), name
    assert not stock_llm.llm_engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def servers(tiny_model_path, tmp_path_factory, shared_servers):
    """A hooked (the suite's shared one) and a stock `vllm serve` of the
    tiny model."""
    hooked = shared_servers.get("hooked").base
    logs = tmp_path_factory.mktemp("client-join-servers")
    with running_server(tiny_model_path,
                        logs / "stock.log",
                        special_kwargs=None,
                        extra=STOCK_SERVER_OPTIONS) as stock:
        yield hooked, stock


async def hooked_completion(session, base: str, model: str, prompt_ids,
                            program, hook_ids, max_tokens: int) -> dict:
    """One scripted request to the hooked server, streamed: its token ids,
    text and finish reason."""
    body = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        **scripted_request_body(program, hook_ids),
    }
    token_ids, text, reason = [], "", None
    async for choice in stream_completion(session, base, body):
        token_ids += [
            int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]
        ]
        text += choice["text"]
        reason = choice["finish_reason"] or reason
    return {"token_ids": token_ids, "text": text, "finish_reason": reason}


async def both_sides(servers, model: str, hook_ids, max_tokens: int):
    hooked_base, stock_base = servers
    all_cases = cases(hook_ids)
    from vllm.transformers_utils.tokenizer import get_tokenizer
    tokenizer = get_tokenizer(model)
    prompts = [tokenizer.encode(c[2]) for c in all_cases]
    async with client_session() as session:
        max_model_len = await server_max_model_len(session, stock_base, model)
        sender = HttpSender(session, stock_base, model, {"temperature": 0.0})
        hooked = asyncio.gather(*(hooked_completion(
            session, hooked_base, model, prompt, c[1], hook_ids, max_tokens)
                                  for prompt, c in zip(prompts, all_cases)))
        joined = asyncio.gather(
            *(run_join(sender, f"join-{max_tokens}-{i}", prompt, max_tokens,
                       hooks_of(hook_ids), max_model_len, tokenizer,
                       scripted_options(c[1], hook_ids, over_http=True))
              for i, (prompt, c) in enumerate(zip(prompts, all_cases))))
        return all_cases, await hooked, await joined


@pytest.mark.parametrize("max_tokens", BUDGETS)
def test_http_join_on_stock_server_equals_hooked_server(
        servers, tiny_model_path, hook_ids, hooked_llm, max_tokens):
    all_cases, hooked, joined = asyncio.run(
        both_sides(servers, str(tiny_model_path), hook_ids, max_tokens))
    # The served trees are the in-process hooked engine's (the same model,
    # dtype and greedy choices).
    engine_outputs = run_hooked(hooked_llm, hook_ids,
                                [c[2] for c in all_cases],
                                [c[1] for c in all_cases], max_tokens)
    for (name, _, _), served, result, output in zip(all_cases, hooked, joined,
                                                    engine_outputs):
        assert result.token_ids == served["token_ids"], name
        assert result.text == served["text"], name
        assert result.finish_reason == served["finish_reason"], name
        assert_same_tree(result.promise_tree,
                         output.promise_tree,
                         exact_aborts=False)
        assert (result.requests, result.prompt_tokens) == expected_traffic(
            output, hook_ids.sync), name


def test_http_transport_reports_a_refused_request(servers, tiny_model_path,
                                                  hook_ids):
    """A request the stock server refuses fails the join with its error
    instead of leaving it waiting."""

    async def join_too_long_prompt():
        from vllm.transformers_utils.tokenizer import get_tokenizer
        model = str(tiny_model_path)
        async with client_session() as session:
            sender = HttpSender(session, servers[1], model)
            # max_model_len is told wrong on purpose: the prompt does not
            # fit the server's.
            return await run_join(sender, "too-long", [1] * 300, 8,
                                  hooks_of(hook_ids), 4096,
                                  get_tokenizer(model))

    with pytest.raises(RuntimeError, match="join too-long failed"):
        asyncio.run(join_too_long_prompt())
