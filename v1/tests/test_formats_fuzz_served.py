# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fuzzed format inputs through a served engine: each format's toy model
behind `vllm serve --special-kwargs '{"format": ...}'` (the suite's
shared server of the format, which the in-engine tests' API cases use
too), sent a batch of odd requests at once: prompts with the format's
tags inside them, tags cut short, non-ASCII text, values of another
type where the format has a list, prompts that push the toy off its
format, and outputs forced odd where the server allows it (`logit_bias`
toward a tag, an EOS or a BOS; budgets of one and a few tokens; stop
strings; seeded samples).

What a user of such a server must be able to count on, whatever the
model writes:

- an answer to every request: 200, or a 400 with its reason for one the
  server refuses at start; never an error out of the engine core, which
  ends every request it holds (the server then answers no more);
- no hang: every request has `REQUEST_TIMEOUT_S`, and a failure names it;
- each answer ended as the format's reference ends it on the same
  samples: a ThreadWeaver answer is the references' controller's when
  each of its calls samples what the engine sampled (its root's tokens,
  each thread's); an APR answer holds each round's join as the
  reference writes it from the sub-searches' traces, and ends with a
  call of sub-searches only where the reference gives up on it or the
  search made it before (where the reference would repeat it forever).
  A request's own stop strings are a documented difference
  (docs/formats.md): those answers are not compared;
- after the batch, nothing held: no request running or waiting, no KV
  block used, no child running, no parent parked (`assert_idle`, which
  fails on a metric missing from /metrics); then the server answers a
  search that forks.

The servers take more children a fork than their defaults
(`toy_server.CHILD_LIMITS`), so that a prompt with many labels forks each
one, as the controllers do.
"""

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest
import requests
from transformers import AutoTokenizer

from sequence_hooks_references.formats import apr_trace
from sequence_hooks_references.formats import threadweaver_controller as tw
from sequence_hooks_references.formats.backends import ScriptedBackend
from sequence_hooks_testkit.formats.toy_server import (FORMAT_TOYS, choices,
                                                       held_out_prompts)
from sequence_hooks_testkit.v1_server import assert_idle

# The shared servers its tests use (conftest's `shared_servers`).
pytestmark = pytest.mark.shares("threadweaver toy", "apr toy")

REQUEST_TIMEOUT_S = 300
IDLE_TIMEOUT_S = 120
IN_FLIGHT = 8
# The toys' folders and context windows (APR's searches are longer).
TW_TOY, TW_WINDOW, _ = FORMAT_TOYS["threadweaver"]
APR_TOY, APR_WINDOW, _ = FORMAT_TOYS["apr"]


@dataclass(frozen=True)
class Ask:
    """One request: its name, its prompt, what it sets beside the plain
    greedy request, and what a refusal's reason says (None: answered)."""

    name: str
    prompt: Any
    change: dict = field(default_factory=dict)
    refused: Optional[str] = None


@dataclass(frozen=True)
class Served:
    """A running server of a format's toy."""

    name: str
    url: str
    model: Path
    window: int
    tokenizer: Any
    # Its output (an error out of the engine core shows there).
    log: Path

    def body(self, ask: Ask) -> dict:
        """The request ``ask`` makes: greedy, a budget of 400 unless it
        sets one, token ids back."""
        return {
            "model": str(self.model),
            "prompt": ask.prompt,
            "max_tokens": 400,
            "temperature": 0.0,
            "return_token_ids": True,
            **ask.change,
        }


def refused_asks(tokenizer, plain: Any) -> list[Ask]:
    """What every format's server refuses with its reason: an empty
    prompt, a bias toward a token outside the vocabulary."""
    return [
        Ask("an empty prompt", "", refused="non-empty"),
        Ask("a bias out of the vocabulary",
            plain, {"logit_bias": {
                str(len(tokenizer) + 5): 1
            }},
            refused="out-of-vocab"),
    ]


def tw_asks(tokenizer) -> list[Ask]:
    """ThreadWeaver's odd requests, from the toy's first held-out prompt
    (``"1: 24 ; 11: 784 854 549 480 734\\n"``: one outline a group)."""
    plain = held_out_prompts(TW_TOY, 1)[0]
    ids = {
        tag: tokenizer.convert_tokens_to_ids(tag)
        for tag in ("<Outlines>", "</Outlines>", "<Thread>", "</Thread>")
    } | {
        "eos": tokenizer.eos_token_id
    }
    many = " ; ".join(f"{i}: 5" for i in range(1, 40)) + "\n"
    return [
        Ask("plain", plain),
        Ask("outlines inside the prompt",
            "<Outlines>\n<Outline>1: x</Outline>\n" + plain),
        Ask("a closing tag at the prompt's end", plain + "</Outlines>"),
        Ask("the prompt ends in a thread", plain + "<Thread>\n1:"),
        Ask("the prompt ends in an outline",
            plain + "<Parallel>\n<Outlines>\n<Outline>1:"),
        Ask("tags out of place", "</Thread></Outlines><Outlines>"),
        Ask("tags cut short", "</Outlines <Outline 1: 2\n"),
        Ask("non-ASCII", "é 中文 🙂 " + plain),
        Ask("a repeated label", "1: 5 ; 1: 6 ; 1: 7\n"),
        Ask("39 labels", many),
        Ask("a huge number", "99999999999999999999999: 1 2\n"),
        Ask("special tokens spelled", "<s></s>" + plain),
        Ask("</Outlines> forced", plain,
            {"logit_bias": {
                str(ids["</Outlines>"]): 100
            }}),
        Ask(
            "<Outlines> and </Outlines> forced", many, {
                "logit_bias": {
                    str(ids["<Outlines>"]): 50,
                    str(ids["</Outlines>"]): 50
                }
            }),
        Ask("<Thread> pushed", plain,
            {"logit_bias": {
                str(ids["<Thread>"]): 30
            }}),
        Ask("threads closed at once", plain,
            {"logit_bias": {
                str(ids["</Thread>"]): 100
            }}),
        Ask("EOS forced", plain, {"logit_bias": {
            str(ids["eos"]): 100
        }}),
        Ask("a budget of one", plain, {"max_tokens": 1}),
        Ask("a budget of three, </Outlines> forced", plain, {
            "max_tokens": 3,
            "logit_bias": {
                str(ids["</Outlines>"]): 100
            }
        }),
        Ask("a budget ending in a join", many, {"max_tokens": 60}),
        Ask("seeded samples", plain, {
            "temperature": 1.0,
            "seed": 7,
            "n": 2
        }),
        Ask("stop strings", plain, {"stop": ["\n\n", ":"]}),
        *refused_asks(tokenizer, plain),
    ]


def apr_asks(tokenizer) -> list[Ask]:
    """APR's odd requests, from the toy's first held-out prefix (the
    model's BOS as text before each, as APR's controller sends it)."""
    bos = tokenizer.bos_token
    prefix = held_out_prompts(APR_TOY, 1)[0]
    plain = bos + prefix
    ids = {
        tag: tokenizer.convert_tokens_to_ids(tag)
        for tag in ("<Sub Searches>", "<End Calling Sub Searches>",
                    "<Calling Sub Searches>")
    } | {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id
    }
    call = ("<Calling Sub Searches>\n<Start Sub Search 0 at level 1> "
            "Moving to Node #0,0\n<End Calling Sub Searches>")
    # A prompt a few tokens short of the window: a model forced to write
    # `<Sub Searches>` has it rewritten until the window ends the search.
    filler = ("\nExploring Operation: 69-56=13, Resulting Numbers: "
              "[13, 17, 29]")
    near = plain + filler * (
        (APR_WINDOW - 8 - len(tokenizer.encode(plain))) //
        len(tokenizer.encode(filler, add_special_tokens=False)))
    return [
        Ask("plain", plain),
        Ask("operations None", plain.replace("[]", "None")),
        Ask("operations a string", plain.replace("[]", "'x'")),
        Ask("nested numbers", plain.replace(":[", ":[[1, [2]], ")),
        Ask("a huge target",
            bos + re.sub(r"State: \d+", "State: " + "9" * 40, prefix)),
        Ask("a call inside the prompt", plain + "\n" + call),
        Ask("a call of a malformed node inside the prompt",
            plain + "\nGenerated Node #0,0: 64:5 Operation: x\n" + call),
        Ask("<Sub Searches> inside the prompt", plain + "<Sub Searches>"),
        Ask("non-ASCII", plain.replace("Node #0", "Node #0 é中")),
        Ask("a BOS alone", bos),
        Ask("tags cut short", plain + "\n<Calling Sub Sea"),
        Ask("<Sub Searches> forced to the window", near,
            {"logit_bias": {
                str(ids["<Sub Searches>"]): 100
            }}),
        Ask(
            "calls with no header", bos, {
                "logit_bias": {
                    str(ids["<End Calling Sub Searches>"]): 30
                },
                "max_tokens": 60
            }),
        Ask(
            "<Calling Sub Searches> pushed", plain, {
                "logit_bias": {
                    str(ids["<Calling Sub Searches>"]): 20
                },
                "max_tokens": 200
            }),
        Ask("BOS mid-text", plain, {"logit_bias": {
            str(ids["bos"]): 10
        }}),
        Ask("EOS forced", plain, {"logit_bias": {
            str(ids["eos"]): 100
        }}),
        Ask("a budget of one", plain, {"max_tokens": 1}),
        Ask("a budget of three", plain, {"max_tokens": 3}),
        Ask("stop strings", plain, {"stop": ["Operation", "\n\n"]}),
        *refused_asks(tokenizer, plain),
    ]


FORMATS = {
    "threadweaver": (TW_TOY, TW_WINDOW, tw_asks),
    "apr": (APR_TOY, APR_WINDOW, apr_asks),
}


@pytest.fixture(scope="module", params=list(FORMATS))
def served(request, shared_servers) -> Served:
    """The suite's shared server of the format's toy
    (`toy_server.start_format_server`, with `CHILD_LIMITS`)."""
    name = request.param
    model, window, _ = FORMATS[name]
    server = shared_servers.get(f"{name} toy")
    served = Served(name, server.url, model, window,
                    AutoTokenizer.from_pretrained(model), server.log)
    # The gauges show on /metrics once set: a first search sets them
    # (`assert_idle` fails on a metric that is not there).
    assert_forks(served)
    return served


def assert_forks(served: Served) -> None:
    """The server answers its toy's first held-out prompt with a tree
    that forks."""
    [prompt] = held_out_prompts(served.model, 1)
    if served.name == "apr":
        prompt = served.tokenizer.bos_token + prompt
    _, answer = choices(served.url,
                        "/v1/completions",
                        served.body(Ask("plain", prompt)),
                        timeout=REQUEST_TIMEOUT_S)
    assert answer["kv_transfer_params"]["promise_tree"]["children"]


def send(served: Served, ask: Ask) -> tuple[int, dict]:
    """One request's status and answer (the error's, refused)."""
    try:
        response = requests.post(served.url + "/v1/completions",
                                 json=served.body(ask),
                                 timeout=REQUEST_TIMEOUT_S)
    except requests.Timeout:
        pytest.fail(f"{served.name}, {ask.name!r}: no answer in "
                    f"{REQUEST_TIMEOUT_S} s")
    return response.status_code, response.json()


def trees(answer: dict) -> list[Optional[dict]]:
    """Each sample's tree (None: it forked nothing), by choice."""
    params = answer.get("kv_transfer_params") or {}
    if "promise_trees" in params:
        return [
            params["promise_trees"].get(str(c["index"]))
            for c in answer["choices"]
        ]
    return [params.get("promise_tree")] * len(answer["choices"])


# A token the replay gives where the engine sampled nothing: the answer
# then differs from the engine's, wherever the controller went.
UNSAMPLED_PAD = "<pad>"


def assert_threadweaver_as_the_controller(served: Served, ask: Ask,
                                          choice: dict,
                                          tree: Optional[dict]) -> None:
    """The references' controller, each of its calls answered with what
    the engine sampled after the same context (the root's tokens, each
    thread's after its fork and header), gives the engine's answer, up
    to the window."""
    tokenizer = served.tokenizer
    prompt, answer = choice["prompt_token_ids"], choice["token_ids"]
    sampled: dict[tuple[int, ...], int] = {}

    def follow(context: list[int], tokens: list[int]) -> None:
        for at, token in enumerate(tokens):
            sampled[tuple(context + tokens[:at])] = token

    follow(prompt, answer)
    for child in (tree or {}).get("children") or ():
        header = tokenizer.encode(tw.first_header(child["label"]),
                                  add_special_tokens=False)
        follow(prompt + answer[:child["fork_position"]] + header,
               child["token_ids"])
    pad = tokenizer.convert_tokens_to_ids(UNSAMPLED_PAD)
    [[rollout]] = tw.run(
        tw.ThreadWeaverController(
            tokenizer, response_length=served.body(ask)["max_tokens"]),
        ScriptedBackend(lambda context: sampled.get(tuple(context), pad),
                        tokenizer.eos_token_id, served.window), [prompt])
    # A join past the window is cut there (the controller appends it
    # all: a documented difference).
    assert rollout.token_ids[:served.window - len(prompt)] == answer, ask.name


def reference_gives_up(trace: str) -> bool:
    """Whether the reference's `call_search` gives up on the trace's
    call: any error of reading it."""
    try:
        apr_trace.sub_search_info(trace)
    except Exception:
        return True
    return False


def assert_apr_as_the_reference(served: Served, ask: Ask, choice: dict,
                                tree: Optional[dict]) -> None:
    """Each round's join as the reference writes it from its
    sub-searches' final traces (the children of a round share their fork
    position), in order; a call of sub-searches left at the end only
    where the reference gives up on it, or where the search made it
    before: the reference's join of it (with the last round's results)
    is then what it was sent, and the reference would make it forever.
    The final trace is the prompt's text and the answer's (no request
    here has a join cut its prompt away, which would leave the answer's
    alone)."""
    tokenizer = served.tokenizer
    bos = tokenizer.bos_token
    shown = tokenizer.decode(choice["prompt_token_ids"],
                             skip_special_tokens=False)
    prefix = apr_trace.generated(bos, shown[len(bos):], "")
    # Every request is a search's root: its tree is there, forked or not.
    assert tree is not None, ask.name
    trace = prefix + tree["text"]
    rounds: dict[int, list[dict]] = {}
    for child in tree["children"]:
        rounds.setdefault(child["fork_position"], []).append(child)
    last: list[dict] = []
    start = len(prefix)
    for last in rounds.values():
        join = apr_trace.after_sub_searches(
            "<Calling Sub Searches>\n<End Calling Sub Searches>",
            [{
                "node": child["label"]
            } for child in last],
            [apr_trace.search_result(child["text"]) for child in last])
        found = trace.find(join, start)
        assert found >= 0, (ask.name, join, trace)
        start = found + len(join)
    if apr_trace.calls_sub_searches(trace) and not reference_gives_up(trace):
        _, nodes = apr_trace.sub_search_info(trace)
        results = {
            child["label"]: apr_trace.search_result(child["text"])
            for child in last
        }
        join = apr_trace.after_sub_searches(
            trace, nodes, [results.get(node["node"]) for node in nodes])
        assert trace.startswith(join), (ask.name, join, trace)


def test_odd_requests_are_answered_as_the_reference_and_leave_nothing(served):
    asks = FORMATS[served.name][2](served.tokenizer)
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        sent = list(pool.map(lambda ask: send(served, ask), asks))
    # Every request's status first: an error out of the engine core fails
    # every request it held, whichever caused it (its log says).
    wrong = [(ask.name, status, answer.get("error"))
             for ask, (status, answer) in zip(asks, sent)
             if status != (200 if ask.refused is None else 400)]
    assert not wrong, (wrong, served.log.read_text()[-5000:])
    for ask, (_, answer) in zip(asks, sent):
        if ask.refused is not None:
            assert ask.refused in answer["error"]["message"], ask.name
            continue
        for choice, tree in zip(answer["choices"], trees(answer)):
            assert choice["finish_reason"] in ("stop", "length"), ask.name
            if "stop" in ask.change:
                continue
            if served.name == "threadweaver":
                assert_threadweaver_as_the_controller(served, ask, choice,
                                                      tree)
            else:
                assert_apr_as_the_reference(served, ask, choice, tree)
    assert_idle(served.url, IDLE_TIMEOUT_S)
    assert requests.get(served.url + "/health", timeout=10).status_code == 200
    assert_forks(served)
