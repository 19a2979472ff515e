# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NPR and Multiverse served in-engine, checked from outside the engine.

Each toy model (models/npr-toy, models/multiverse-toy) was trained with
its format's layout: paths at the positions of the goal's newline on,
unseen by their siblings, what follows a block one past the longest
path. Served greedy with a KV block of 32 tokens (the CPU backend's
least; paths start inside blocks, so the join both adopts blocks and
copies tokens), every answer
is checked against the references, which share no code with the engine
(`sequence_hooks_references.parallel_layout` and `.layout_check`):

- every token the model sampled, root and paths, is the argmax of ONE
  Hugging Face forward of the same checkpoint over the whole final
  sequence with the layout's 4-D mask and position ids;
- the answer is the sequential reference decoder's, token for token;
- the same check rejects a join that concatenates the paths and
  prefills them (so it can tell the difference);
- the tree holds each path's label, tokens and logprobs;
- the scheduler computes, at a join, the closing tag alone;
- over `vllm serve` (completions and chat, whole and streamed) the
  answers are the offline ones, and a prompt that repeats a spliced
  answer's tokens gets no prefix-cache hit past its first fork.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sequence_hooks_references.layout_check import (decode_sequential,
                                                    greedy_mismatches,
                                                    layout_logits)
from sequence_hooks_references.parallel_layout import FORMATS, prefill_layout
from sequence_hooks_testkit.formats.toy_server import (SPLICE_BLOCK_SIZE,
                                                       choices,
                                                       held_out_prompts)
from sequence_hooks_testkit.v1_server import assert_idle

# The shared servers its tests use (conftest's `shared_servers`).
pytestmark = pytest.mark.shares("npr toy", "multiverse toy")

ROOT = Path(__file__).resolve().parents[2]
MODELS = {name: ROOT / "models" / f"{name}-toy" for name in FORMATS}
# The served toys' KV block size, the offline engine's too.
BLOCK_SIZE = SPLICE_BLOCK_SIZE
MAX_MODEL_LEN = 512
# Every held-out prompt of the toys (prompts.jsonl).
NUM_PROMPTS = 24
# Answers decoded again by the sequential reference (one forward a token:
# the suite's slowest check).
NUM_DECODED = 8
# How far a logprob in the tree may be from the reference forward's (the
# same fp32 model, other batch shapes).
LOGPROB_TOLERANCE = 1e-3


def special_kwargs(name: str) -> str:
    return json.dumps({"format": name})


@pytest.fixture(scope="module", params=sorted(FORMATS))
def served_format(request, tmp_path_factory):
    """A format's toy, its reference model and its offline answers."""
    name = request.param
    model = MODELS[name]
    prompts = held_out_prompts(model, NUM_PROMPTS)
    folder = tmp_path_factory.mktemp(name)
    cases = folder / "cases.json"
    cases.write_text(
        json.dumps([{
            "name": name,
            "prompts": prompts,
            "max_tokens": None,
            "sampling": {
                "logprobs": 0
            },
        }]))
    subprocess.run([
        sys.executable, "-m", "sequence_hooks_testkit.formats.run_in_engine",
        str(model), name, cases, folder / "out.json", "--block-size",
        str(BLOCK_SIZE), "--max-model-len",
        str(MAX_MODEL_LEN)
    ],
                   check=True,
                   timeout=1800)
    answers = json.loads((folder / "out.json").read_text())[0]["answers"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    reference = AutoModelForCausalLM.from_pretrained(
        model, torch_dtype=torch.float32, attn_implementation="eager")
    prompt_ids = [
        tokenizer.encode(prompt, add_special_tokens=False)
        for prompt in prompts
    ]
    return name, model, tokenizer, reference, prompt_ids, answers


def forking(answers: list[dict]) -> list[int]:
    """The answers whose tree has paths."""
    return [
        i for i, answer in enumerate(answers)
        if answer["tree"] is not None and answer["tree"]["children"]
    ]


def test_most_answers_fork(served_format):
    """The check below is not vacuous: the toy forks."""
    *_, answers = served_format
    assert len(forking(answers)) >= len(answers) // 2


def test_every_sampled_token_is_the_layouts_argmax(served_format):
    assert_the_layouts_argmax(served_format)


def assert_the_layouts_argmax(served_format) -> None:
    """Every token an answer sampled, root and paths, is the argmax of
    the reference forward over its final sequence with the layout.

    Args:
        served_format: A format's answers as `served_format` holds them.
    """
    name, _, tokenizer, reference, prompt_ids, answers = served_format
    tags = FORMATS[name].tags(tokenizer)
    for prompt, answer in zip(prompt_ids, answers, strict=True):
        ids = prompt + answer["token_ids"]
        assert greedy_mismatches(reference, ids, len(prompt), tags) == []


def test_a_concatenate_and_prefill_join_fails_that_check(served_format):
    name, _, tokenizer, reference, prompt_ids, answers = served_format
    tags = FORMATS[name].tags(tokenizer)
    failed = 0
    for i in forking(answers):
        prompt = prompt_ids[i]
        ids = prompt + answers[i]["token_ids"]
        failed += bool(
            greedy_mismatches(reference,
                              ids,
                              len(prompt),
                              tags,
                              layout=prefill_layout))
    assert failed > 0


def test_answers_are_the_sequential_reference_decoders(served_format):
    """Token for token, and path by path with their labels."""
    name, _, tokenizer, reference, prompt_ids, answers = served_format
    for prompt, answer in list(zip(prompt_ids, answers))[:NUM_DECODED]:
        decoded = decode_sequential(reference, tokenizer, prompt,
                                    FORMATS[name], MAX_MODEL_LEN - len(prompt))
        assert decoded.ids[len(prompt):] == answer["token_ids"]
        if answer["tree"] is None:
            assert not decoded.paths
            continue
        top = [path for path in decoded.paths if path.depth == 0]
        assert [c["label"] for c in answer["tree"]["children"]
                ] == [path.label for path in top]


def placed_nodes(node: dict, offset: int, ids: list[int], tokenizer,
                 fmt) -> list[tuple[dict, int]]:
    """The node and its descendants, each with the index in ``ids`` (the
    answer's final sequence) where its own tokens start.

    A block's paths follow the newline after the fork in label order, each
    after its header; a path's nested blocks lie within its own tokens.
    """
    own = node["token_ids"]
    assert ids[offset:offset + len(own)] == own
    placed = [(node, offset)]
    cursor, fork = None, None
    for child in node["children"]:
        if child["fork_position"] != fork:
            fork = child["fork_position"]
            # The goal's closing tag is the last token of the fork.
            assert ids[offset + fork - 1] == fmt.tags(tokenizer).goal_close
            cursor = offset + fork + 1
        header = tokenizer.encode(fmt.header(child["label"]),
                                  add_special_tokens=False)
        assert ids[cursor:cursor + len(header)] == header
        placed += placed_nodes(child, cursor + len(header), ids, tokenizer,
                               fmt)
        cursor += len(header) + len(child["token_ids"])
    return placed


def test_the_tree_carries_each_paths_tokens_and_logprobs(served_format):
    assert_trees_carry_the_layouts_logprobs(served_format)


def assert_trees_carry_the_layouts_logprobs(served_format) -> None:
    """Every node of the tree, nested paths too, holds its own tokens (a
    path's header is its context, its forced newline its last token) with
    the reference forward's logprob for each token it sampled, and none
    for each token merged into it (a newline, a join's spliced paths and
    closing tag), as `merged_spans` says.

    Args:
        served_format: A format's answers as `served_format` holds them.
    """
    name, _, tokenizer, reference, prompt_ids, answers = served_format
    fmt = FORMATS[name]
    tags = fmt.tags(tokenizer)
    nested = 0
    for i in forking(answers):
        answer, prompt = answers[i], prompt_ids[i]
        ids = prompt + answer["token_ids"]
        assert answer["tree"]["token_ids"] == answer["token_ids"]
        expected = torch.log_softmax(layout_logits(reference, ids, tags),
                                     dim=-1)
        for node, offset in placed_nodes(answer["tree"], len(prompt), ids,
                                         tokenizer, fmt):
            own, logprobs = node["token_ids"], node["logprobs"]
            merged = [False] * len(own)
            for start, count in node["merged_spans"]:
                merged[start:start + count] = [True] * count
            assert [entry is None for entry in logprobs] == merged
            if node["depth"] > 0:
                assert tokenizer.decode(own).endswith(fmt.path_close + "\n")
                assert merged[-1]
            nested += node["depth"] > 1
            for k, entry in enumerate(logprobs):
                if entry is not None:
                    at = offset + k
                    assert entry == pytest.approx(expected[at - 1,
                                                           ids[at]].item(),
                                                  abs=LOGPROB_TOLERANCE)
    # Multiverse's toy nests: the recursion above is not vacuous.
    assert nested > 0 or not fmt.nests


def test_a_join_computes_its_closing_tag_alone(served_format):
    """What the engine's scheduler gave each member of a tree to compute
    (`SchedulerOutput.num_scheduled_tokens`, per step): a path first the
    goal's closing tag, the newline and its header (its parent's KV holds
    the rest), then one token a step and, at its end, its closing tag with
    the newline given to it; at each join, its member the format's
    closing text alone: no path's token is computed again."""
    name, _, tokenizer, _, prompt_ids, answers = served_format
    fmt = FORMATS[name]
    closing = len(tokenizer.encode(fmt.after_text(), add_special_tokens=False))
    for i in forking(answers):
        answer = answers[i]
        ids = prompt_ids[i] + answer["token_ids"]
        for node, _ in placed_nodes(answer["tree"], len(prompt_ids[i]), ids,
                                    tokenizer, fmt):
            counts = answer["scheduled"][node["request_id"]]
            joins = len({child["fork_position"] for child in node["children"]})
            expected = [closing] * joins
            if node["depth"] > 0:
                header = tokenizer.encode(fmt.header(node["label"]),
                                          add_special_tokens=False)
                assert counts[0] == 2 + len(header)
                expected.append(2)
            assert sorted(count for count in counts[1:]
                          if count != 1) == sorted(expected)


@pytest.fixture(scope="module")
def served(served_format, shared_servers) -> str:
    """`vllm serve` of the format's toy, as a user starts it: the suite's
    shared one (`toy_server.start_format_server`: KV blocks of
    `BLOCK_SIZE`, a chat template that renders the user's message as it
    is, more children a fork than the defaults, which the toys never
    reach)."""
    name, *_ = served_format
    return shared_servers.get(f"{name} toy").url


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_over_the_api_the_answers_are_the_offline_ones(served_format, served,
                                                       chat, stream):
    """Tokens, whole or streamed; whole, the tree's paths too."""
    name, model, tokenizer, _, prompt_ids, answers = served_format
    for prompt, answer in list(zip(prompt_ids, answers))[:6]:
        body = {
            "model": str(model),
            "max_tokens": MAX_MODEL_LEN - len(prompt),
            "temperature": 0.0,
            "return_token_ids": True,
            "stream": stream,
        }
        if chat:
            body["messages"] = [{
                "role": "user",
                "content": tokenizer.decode(prompt)
            }]
        else:
            body["prompt"] = prompt
        path = "/v1/chat/completions" if chat else "/v1/completions"
        got, whole = choices(served, path, body, timeout=300)
        assert [t for c in got
                for t in c.get("token_ids") or ()] == answer["token_ids"]
        if stream:
            continue
        tree = (whole.get("kv_transfer_params") or {}).get("promise_tree")
        if answer["tree"] is None:
            assert tree is None
            continue
        assert [(c["label"], c["token_ids"]) for c in tree["children"]] == [
            (c["label"], c["token_ids"]) for c in answer["tree"]["children"]
        ]


def test_a_spliced_answer_is_no_prefix_hit_past_its_fork(
        served_format, served):
    """A request whose prompt repeats a spliced answer's tokens shares
    the blocks before the first fork only (their KV is a plain prefix's);
    the same prompt again shares its own blocks (the cache works)."""
    _, model, _, _, prompt_ids, answers = served_format
    i = forking(answers)[0]
    ids = prompt_ids[i] + answers[i]["token_ids"]
    fork = len(
        prompt_ids[i]) + answers[i]["tree"]["children"][0]["fork_position"]
    assert len(ids) - fork > 2 * BLOCK_SIZE

    def cached_tokens() -> int:
        _, whole = choices(
            served, "/v1/completions", {
                "model": str(model),
                "prompt": ids,
                "max_tokens": 1,
                "temperature": 0.0,
            })
        return whole["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached_tokens() <= fork // BLOCK_SIZE * BLOCK_SIZE
    assert cached_tokens() >= (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_the_server_holds_nothing_afterwards(served_format, served):
    """Every path's kept blocks were taken by its join or freed: no KV
    block in use, no tree, no parked parent (the gauges read; a missing
    one fails)."""
    assert_idle(served, timeout_s=30)
