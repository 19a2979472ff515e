# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""APR's format served in-engine by the V1 plugin
(``special_kwargs={"format": "apr"}``) against APR's own controller over
stock vLLM, on models/apr-toy, greedy, each side in a process of its own:
the same final trace for every search, each sub-search's trace in the
tree as the controller's child, offline (`LLM(..., special_kwargs=)`)
and over the OpenAI API (`vllm serve --special-kwargs`), completions and
chat, whole and streamed: text and token ids (the trace re-tokenized, as
the engine's join is), and each whole answer's tree, its logprobs those
the controller's calls sampled.

The prompt is what APR's controller sends: the model's BOS as text, then
the root's ``Moving to Node #0`` prefix; every call's budget is the
request's ``max_tokens`` (the controller's, per call).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from sequence_hooks_testkit.formats.toy_server import choices

# The shared servers its tests use (conftest's `shared_servers`).
pytestmark = pytest.mark.shares("apr toy")

# The two runners' packages: the controllers' (a client of stock vLLM)
# and the in-engine formats'.
REFERENCES = "sequence_hooks_references.formats."
TESTKIT = "sequence_hooks_testkit.formats."
MODEL = Path(__file__).resolve().parents[2] / "models" / "apr-toy"
TOKENIZER = AutoTokenizer.from_pretrained(MODEL)
BOS = TOKENIZER.bos_token
PREFIXES = [
    json.loads(line)["prompt"]
    for line in (MODEL / "prompts.jsonl").read_text().splitlines()
][:8]
MAX_MODEL_LEN = 2048
MAX_TOKENS = 400
GREEDY = {"temperature": 0.0, "logprobs": 1}


def run(module: str, args: list, cases: list, folder: Path) -> list:
    (folder / "cases.json").write_text(json.dumps(cases))
    subprocess.run([
        sys.executable, "-m", module,
        str(MODEL), *args, folder / "cases.json", folder / "out.json",
        "--max-model-len",
        str(MAX_MODEL_LEN)
    ],
                   check=True,
                   timeout=1500)
    [case] = json.loads((folder / "out.json").read_text())
    return case


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> tuple[list, list]:
    """The controller's searches and the engine's answers."""
    controller = run(REFERENCES + "run_apr", [], [{
        "name": "greedy",
        "prompts": PREFIXES,
        "max_tokens": MAX_TOKENS,
        "sampling": GREEDY
    }], tmp_path_factory.mktemp("controller"))["searches"]
    engine = run(TESTKIT + "run_in_engine", ["apr"],
                 [{
                     "name": "greedy",
                     "prompts": [BOS + prefix for prefix in PREFIXES],
                     "max_tokens": MAX_TOKENS,
                     "sampling": GREEDY,
                     "text": True
                 }], tmp_path_factory.mktemp("engine"))["answers"]
    return controller, engine


def test_the_engine_ends_with_the_controllers_trace(answers):
    controller, engine = answers
    for prefix, search, answer in zip(PREFIXES,
                                      controller,
                                      engine,
                                      strict=True):
        assert prefix + answer["text"] == search["trace"]
        # The trace's ids, then the EOS that ended the last call.
        eos = [TOKENIZER.eos_token_id
               ] if answer["finish_reason"] == "stop" else []
        assert answer["token_ids"] == TOKENIZER.encode(
            search["trace"][len(prefix):], add_special_tokens=False) + eos
    # The toy calls sub-searches: the comparison covers joins.
    assert sum(len(search["rounds"]) for search in controller) > 0


def test_the_tree_holds_each_sub_search_as_the_controllers(answers):
    controller, engine = answers
    for search, answer in zip(controller, engine):
        children = (answer["tree"] or {}).get("children") or []
        assert [c["text"] for c in children] == [
            trace for round_ in search["rounds"] for trace in round_
        ]
        for child in children:
            assert child["label"].startswith("#0,")


def sampled_by_calls(search: dict) -> dict[tuple[int, ...], float]:
    """Every token the controller's calls sampled, by the ids up to and
    including it: the logprob its call gave it."""
    sampled = {}
    for call in search["calls"]:
        ids = TOKENIZER.encode(call["prompt"])
        for token, logprob in zip(call["token_ids"],
                                  call["logprobs"],
                                  strict=True):
            ids.append(token)
            sampled[tuple(ids)] = logprob
    return sampled


def nodes_with_context(tree: dict, prefix: str) -> list[tuple[list, dict]]:
    """The tree's nodes, each after the ids its calls were sent before its
    tokens: the root's prompt; the BOS for a sub-search, whose tokens are
    its whole trace."""
    return [(TOKENIZER.encode(BOS + prefix), tree),
            *((TOKENIZER.encode(BOS), child)
              for child in tree.get("children") or ())]


def assert_logprobs_are_the_calls(tree: dict, prefix: str,
                                  sampled: dict) -> int:
    """Each node's token has a logprob exactly where a call of the
    controller sampled it after the same ids, and the same one (within
    1e-3: another process's fp32). Returns how many it has."""
    given = 0
    for context, node in nodes_with_context(tree, prefix):
        ids = list(context)
        for token, logprob in zip(node["token_ids"],
                                  node["logprobs"],
                                  strict=True):
            ids.append(token)
            expected = sampled.get(tuple(ids))
            assert (logprob is None) == (expected
                                         is None), (node["label"], len(ids))
            if logprob is not None:
                assert logprob == pytest.approx(expected, abs=1e-3)
                given += 1
    return given


def test_the_tree_s_logprobs_are_those_the_controller_s_calls_sampled(answers):
    """Where the re-tokenized trace agrees with what a call sampled, the
    node has that call's logprob; elsewhere (a join's text, a re-tokenized
    boundary) none."""
    controller, engine = answers
    given = sampled = 0
    for prefix, search, answer in zip(PREFIXES, controller, engine):
        by_ids = sampled_by_calls(search)
        given += assert_logprobs_are_the_calls(answer["tree"], prefix, by_ids)
        sampled += len(by_ids)
    # The toy's tokenizer mostly re-tokenizes as it sampled.
    assert given > 0.9 * sampled


def answer_logprobs(got: list[dict], chat: bool) -> list[float]:
    """The sampled tokens' logprobs of an answer's choices (whole, or
    streamed chunks), from the completions or the chat form."""
    if chat:
        return [
            entry["logprob"] for c in got
            for entry in (c.get("logprobs") or {}).get("content") or ()
        ]
    return [
        logprob for c in got
        for logprob in (c.get("logprobs") or {}).get("token_logprobs") or ()
    ]


@pytest.fixture(scope="module")
def served(shared_servers) -> str:
    """`vllm serve` of the toy with the format, as a user starts it: the
    suite's shared one (`toy_server.start_format_server`, whose chat
    template puts the BOS before the user's message)."""
    return shared_servers.get("apr toy").url


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_over_the_api_the_engine_ends_with_the_controllers_trace(
        answers, served, chat, stream):
    """The answer's text, token ids and logprobs; whole, the tree's
    sub-searches too."""
    controller, _ = answers
    for prefix, search in zip(PREFIXES, controller):
        sampled = sampled_by_calls(search)
        body = {
            "model": str(MODEL),
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "return_token_ids": True,
            "stream": stream,
            "logprobs": 1,
        }
        if chat:
            body["messages"] = [{"role": "user", "content": prefix}]
        else:
            body["prompt"] = BOS + prefix
        path = "/v1/chat/completions" if chat else "/v1/completions"
        got, answer = choices(served, path, body)
        key = "delta" if stream else "message"
        text = "".join((c.get(key) or {}).get("content") or ""
                       for c in got) if chat else "".join(
                           c.get("text") or "" for c in got)
        assert prefix + text == search["trace"]
        token_ids = [t for c in got for t in c.get("token_ids") or ()]
        finish = [c["finish_reason"] for c in got if c.get("finish_reason")]
        eos = [TOKENIZER.eos_token_id] if finish == ["stop"] else []
        assert token_ids == TOKENIZER.encode(search["trace"][len(prefix):],
                                             add_special_tokens=False) + eos
        # Each token's logprob its call sampled it with, or the merged
        # tokens' 0.0 where no call sampled it after these ids.
        context = TOKENIZER.encode(BOS + prefix)
        expected = [
            sampled.get(tuple(context + token_ids[:at + 1]), 0.0)
            for at in range(len(token_ids))
        ]
        assert answer_logprobs(got, chat) == pytest.approx(expected, abs=1e-3)
        if not stream:
            tree = (answer.get("kv_transfer_params")
                    or {}).get("promise_tree") or {}
            assert [c["text"] for c in tree.get("children") or ()] == [
                trace for round_ in search["rounds"] for trace in round_
            ]
            # The API's form of a token's logprobs: [[id, logprob, rank]],
            # the sampled token's first.
            for _, node in nodes_with_context(tree, prefix):
                node["logprobs"] = [
                    None if entry is None else entry[0][1]
                    for entry in node["logprobs"]
                ]
            assert_logprobs_are_the_calls(tree, prefix, sampled)


def test_over_the_api_the_prompt_s_logprobs_come_with_the_answer(
        answers, served):
    """`echo` with `logprobs` (which asks the prompt's logprobs) and
    `prompt_logprobs`: every prompt token after the first has its
    logprob, in both forms, before the answer's (a 500 before: the held
    outputs kept them)."""
    controller, _ = answers
    prefix, search = PREFIXES[0], controller[0]
    prompt = TOKENIZER.encode(BOS + prefix)
    [choice], _ = choices(
        served, "/v1/completions", {
            "model": str(MODEL),
            "prompt": BOS + prefix,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "echo": True,
            "logprobs": 1,
            "prompt_logprobs": 1,
        })
    assert choice["text"] == BOS + search["trace"]
    rows = choice["prompt_logprobs"]
    assert len(rows) == len(prompt) and rows[0] is None
    values = [
        row[str(token)]["logprob"] for row, token in zip(rows[1:], prompt[1:])
    ]
    assert all(value <= 0.0 for value in values)
    echoed = choice["logprobs"]["token_logprobs"]
    assert echoed[0] is None
    assert echoed[1:len(prompt)] == pytest.approx(values)
