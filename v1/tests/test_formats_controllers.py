# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ThreadWeaver's controller (the test kit's client join of its format).

First on scripted completions (its algorithm, step by step), then on
models/threadweaver-toy over stock vLLM V1 offline, in a process of its
own (`run_threadweaver`), for every case its format has: several outlines,
a repeated label, a branch that hits EOS, one that hits the context
window, no outline, two rounds, the <Conclusion> variant, the step cap
and seeded samples; and once over HTTP to a stock `vllm serve`.
"""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sequence_hooks_references.formats.backends import HTTPBackend
from sequence_hooks_references.formats.threadweaver_controller import (
    MAX_ITERATIONS, Completion, ThreadWeaverController, outline_labels, run)
from sequence_hooks_testkit.formats.toy_server import toy_server
from sequence_hooks_training import threadweaver_task as task_mod

MODEL = Path(__file__).resolve().parents[2] / "models" / "threadweaver-toy"
TOKENIZER = task_mod.build_tokenizer()
EOS = TOKENIZER.eos_token_id
THREAD_END = TOKENIZER.convert_tokens_to_ids("</Thread>")
# Held-out prompts of the toy's task (models/threadweaver-toy).
PROMPTS = [
    json.loads(line)["prompt"]
    for line in (MODEL / "prompts.jsonl").read_text().splitlines()
]

# The expectations below are literal texts, as ThreadWeaver's
# `ParallelBranchingController` (facebookresearch/threadweaver,
# single_turn_agent_loop.py) writes them for these labels, not read from
# the controller under test or the format it shares: a branch's header
# "\n<Thread>\n1:" (in the join "<Thread>\n2:" after the first), an
# unclosed branch's "\n</Thread>", after a join "\n" or, where a branch
# ended the answer, "\n</Parallel>" (no_conclusion=False: "\n<Conclusion>\n"
# or "\n<Conclusion>\n</Conclusion>\n</Parallel>").


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


class ScriptedBackend:
    """Answers each call with ``reply(prompt text)``, cut to its
    ``max_tokens`` (finish reason "length") as vLLM does; records the
    calls."""

    def __init__(self, reply, max_model_len: int = 512):
        self.reply = reply
        self.max_model_len = max_model_len
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append(list(zip(prompts, params)))
        done = []
        for prompt, one in zip(prompts, params):
            tokens = ids(self.reply(TOKENIZER.decode(prompt)))
            cut = tokens[:one["max_tokens"]]
            done.append(Completion(cut, "stop" if cut == tokens else "length"))
        return done


def outline_then_thread(prompt: str) -> str:
    """Always outlines label 1 again, and every thread closes."""
    if prompt.endswith("1:"):
        return " 1*5=5\n</Thread>"
    return "<Parallel>\n<Outlines>\n<Outline>1: 5</Outline>\n</Outlines>"


def test_labels_are_the_regex_matches_after_the_last_outlines():
    text = ("<Outlines><Outline>7: a</Outline></Outlines> <Outlines>\n"
            "<Outline> 1.2 : a</Outline><Outline>3:b</Outline>"
            "<Outline>x: c</Outline><Outline>3: d</Outline>")
    assert outline_labels(text) == ["1.2", "3", "3"]
    assert outline_labels("<Outline>1: a</Outline>") == []


def test_a_step_s_calls_their_stops_budgets_and_headers():
    backend = ScriptedBackend(outline_then_thread)
    controller = ThreadWeaverController(TOKENIZER,
                                        max_iterations=2,
                                        max_tokens=100)
    prompt = ids("1: 5\n")
    [[out]] = run(controller, backend, [prompt], {
        "temperature": 0.0,
        "stop_token_ids": [EOS, 7],
        "logprobs": 1
    })
    [[(seq_prompt, seq)], [(branch_prompt, branch)]] = backend.calls
    tags = TOKENIZER.convert_tokens_to_ids
    # Every call asks for the logprobs the request asks for (the rollout
    # keeps them per token: `Rollout.logprobs`).
    assert seq_prompt == prompt and seq["logprobs"] == branch["logprobs"] == 1
    assert seq["stop_token_ids"] == [EOS, 7, tags("</Outlines>")]
    assert branch["stop_token_ids"] == [EOS, 7, tags("</Thread>")]
    assert seq["max_tokens"] == 100
    outline = ids("<Parallel>\n<Outlines>\n<Outline>1: 5</Outline>\n"
                  "</Outlines>")
    assert branch_prompt == prompt + outline + ids("\n<Thread>\n1:")
    assert out.token_ids == outline + ids("\n<Thread>\n1: 1*5=5\n</Thread>"
                                          "\n")
    assert out.ended == "max_iterations" and out.calls == 2


def test_it_gives_up_after_32_steps_sequential_and_parallel_alike():
    backend = ScriptedBackend(outline_then_thread)
    [[out]] = run(ThreadWeaverController(TOKENIZER), backend, [ids("1: 5\n")])
    assert MAX_ITERATIONS == 32
    assert out.ended == "max_iterations"
    assert len(backend.calls) == 32 and len(out.forks) == 16
    assert out.text.count("<Thread>") == 16


def test_the_window_left_is_each_call_s_budget():
    backend = ScriptedBackend(outline_then_thread, max_model_len=40)
    [[out]] = run(ThreadWeaverController(TOKENIZER), backend, [ids("1: 5\n")])
    budgets = [(len(p) + one["max_tokens"]) for step in backend.calls
               for p, one in step]
    assert budgets == [40, 40, 40]
    assert out.ended == "length"


def test_the_response_budget_closes_the_block_and_cuts_the_answer():
    backend = ScriptedBackend(outline_then_thread)
    [[out]] = run(ThreadWeaverController(TOKENIZER, response_length=20),
                  backend, [ids("1: 5\n")])
    assert out.ended == "response_length"
    assert out.forks[0].suffix_ids == ids("\n</Parallel>")
    assert len(out.token_ids) == 20


class ScriptedModel:
    """A scripted model: its sequential steps' texts in order, its
    threads' texts by label."""

    def __init__(self, steps: list[str], threads: dict[str, str]):
        self.steps = list(steps)
        self.threads = threads

    def __call__(self, prompt: str) -> str:
        branch = re.search(r"<Thread>\n([0-9.]+):$", prompt)
        return self.threads[branch[1]] if branch else self.steps.pop(0)


def outlines(*labels: str) -> str:
    return ("<Parallel>\n<Outlines>\n" +
            "".join(f"<Outline>{label}: 5</Outline>\n"
                    for label in labels) + "</Outlines>")


CLOSED = " 1*5=5\n</Thread>"


def scripted(steps, threads, **settings):
    backend = ScriptedBackend(ScriptedModel(steps, threads))
    [[out]] = run(ThreadWeaverController(TOKENIZER, **settings), backend,
                  [ids("1: 5\n")])
    return out, backend


def test_several_outlines_and_a_repeated_label_join_in_label_order():
    out, backend = scripted(
        [outlines("1", "2", "1", "3"), "</Parallel>\nanswer 5</s>"], {
            "1": CLOSED,
            "2": " 2\n</Thread>",
            "3": CLOSED
        })
    [fork] = out.forks
    assert [b.label for b in fork.branches] == ["1", "2", "3"]
    assert [b.joined_ids for b in fork.branches] == [
        ids("\n<Thread>\n1: 1*5=5\n</Thread>"),
        ids("<Thread>\n2: 2\n</Thread>"),
        ids("<Thread>\n3: 1*5=5\n</Thread>")
    ]
    assert fork.suffix_ids == ids("\n")
    assert [len(step) for step in backend.calls] == [1, 3, 1]
    assert out.text == (outlines("1", "2", "1", "3") +
                        "\n<Thread>\n1: 1*5=5\n</Thread><Thread>\n2: 2\n"
                        "</Thread><Thread>\n3: 1*5=5\n</Thread>\n"
                        "</Parallel>\nanswer 5</s>")
    assert out.ended == "eos" and out.calls == 5


@pytest.mark.parametrize(
    "thread, settings, sampled, reason, joined",
    [
        (" 0\nanswer 0</s>", {}, " 0\nanswer 0</s>", "stop",
         "<Thread>\n2: 0\nanswer 0\n</Thread>"),
        # Prompt 5 + outlines 19 + header 5 leave 8 tokens to each branch.
        (" 1*5=5 5*5=5\n</Thread>", {
            "max_model_len": 37
        }, " 1*5=5 5", "length", "<Thread>\n2: 1*5=5 5\n</Thread>")
    ],
    ids=["EOS", "the window"])
def test_a_branch_that_hits_eos_or_the_window_is_closed_and_ends_the_answer(
        thread, settings, sampled, reason, joined):
    """The branch keeps what it sampled; its join is its header, its
    tokens cut before an EOS and the closure; then the block closes and
    the answer ends."""
    out, _ = scripted([outlines("1", "2")], {
        "1": CLOSED,
        "2": thread
    }, **settings)
    [fork] = out.forks
    assert [b.finish_reason for b in fork.branches] == ["stop", reason]
    assert fork.branches[1].token_ids == ids(sampled)
    assert fork.branches[0].joined_ids == ids(
        "\n<Thread>\n1: 1*5=5\n</Thread>")
    assert fork.branches[1].joined_ids == ids(joined)
    assert fork.suffix_ids == ids("\n</Parallel>")
    assert out.text == (outlines("1", "2") +
                        "\n<Thread>\n1: 1*5=5\n</Thread>" + joined +
                        "\n</Parallel>")
    assert out.ended == "thread_ended" and out.calls == 3


def test_outlines_without_a_label_stay_sequential():
    out, backend = scripted(
        [outlines("a"), "\n<Thread>\na: 5\n</Thread>\n</Parallel>\n</s>"], {})
    assert out.forks == [] and out.calls == 2 and out.ended == "eos"
    assert backend.calls[1][0][0] == ids("1: 5\n" + outlines("a"))


def test_two_rounds_of_outlines_fork_the_last_one_s_labels():
    out, _ = scripted([
        outlines("1", "2"), "</Parallel>\n" + outlines("3"),
        "</Parallel>\nanswer 5</s>"
    ], {label: CLOSED
        for label in "123"})
    assert [[b.label for b in f.branches] for f in out.forks] == [["1", "2"],
                                                                  ["3"]]
    assert [f.suffix_ids for f in out.forks] == [ids("\n")] * 2
    assert out.text == (outlines("1", "2") +
                        "\n<Thread>\n1: 1*5=5\n</Thread><Thread>\n2: 1*5=5\n"
                        "</Thread>\n</Parallel>\n" + outlines("3") +
                        "\n<Thread>\n3: 1*5=5\n</Thread>\n</Parallel>\n"
                        "answer 5</s>")
    assert out.calls == 6 and out.ended == "eos"


def test_the_conclusion_variant_opens_an_empty_conclusion():
    out, _ = scripted([outlines("1"), "answer 5</s>"], {"1": CLOSED},
                      no_conclusion=False)
    assert out.forks[0].suffix_ids == ids("\n<Conclusion>\n")
    assert out.text == (outlines("1") + "\n<Thread>\n1: 1*5=5\n</Thread>"
                        "\n<Conclusion>\nanswer 5</s>")
    out, _ = scripted([outlines("1")], {"1": " 0</s>"}, no_conclusion=False)
    assert out.forks[0].suffix_ids == ids(
        "\n<Conclusion>\n</Conclusion>\n</Parallel>")
    assert out.text == (outlines("1") + "\n<Thread>\n1: 0\n</Thread>"
                        "\n<Conclusion>\n</Conclusion>\n</Parallel>")


def test_a_step_with_no_token_ends_the_answer():
    out, _ = scripted([""], {})
    assert out.ended == "no_tokens" and out.token_ids == []


def check_rollout(prompt: list[int], out: dict) -> None:
    """The controller's rules, checked on a rollout of a real model."""
    response = out["token_ids"]
    for k, fork in enumerate(out["forks"]):
        context = prompt + response[:fork["position"]]
        start = len(context) - context[::-1].index(
            TOKENIZER.convert_tokens_to_ids("<Outlines>")) - 1
        labels = re.findall(r"<Outline>\s*([0-9]+(?:\.[0-9]+)*)\s*:",
                            TOKENIZER.decode(context[start:]))
        assert [b["label"]
                for b in fork["branches"]] == list(dict.fromkeys(labels))
        joined, ended = [], False
        for i, branch in enumerate(fork["branches"]):
            tokens = branch["token_ids"]
            # Only the first header opens on a new line.
            header = "\n" * (i == 0) + f"<Thread>\n{branch['label']}:"
            kept = tokens[:tokens.index(EOS)] if EOS in tokens else tokens
            if tokens[-1:] != [THREAD_END]:
                kept = kept + ids("\n</Thread>")
            assert branch["joined_ids"] == ids(header) + kept
            ended |= branch["finish_reason"] == "length" or EOS in tokens
            joined += branch["joined_ids"]
        assert fork["suffix_ids"] == ids("\n</Parallel>" if ended else "\n")
        end = fork["position"] + len(joined) + len(fork["suffix_ids"])
        assert response[fork["position"]:end] == joined + fork["suffix_ids"]
        if ended:
            assert end == len(response) and k == len(out["forks"]) - 1
    assert out["text"] == TOKENIZER.decode(response)


# The toy's held-out prompts, each call capped as the model card measured.
CASES = [
    {
        "name": "greedy",
        "prompts": PROMPTS[:8],
        "settings": {
            "max_tokens": 160
        }
    },
    {
        "name": "window",
        "prompts": PROMPTS[:8],
        "settings": {
            "max_model_len": 120
        }
    },
    {
        "name": "cap",
        "prompts": PROMPTS[:8],
        "settings": {
            "max_tokens": 160,
            "max_iterations": 2
        }
    },
    {
        "name": "seeded",
        "prompts": PROMPTS[:1],
        "settings": {
            "max_tokens": 160
        },
        "sampling": {
            "temperature": 1.0,
            "seed": 7
        },
        "n": 3
    },
] + [{
    "name": f"seed {seed}",
    "prompts": PROMPTS[:1],
    "settings": {
        "max_tokens": 160
    },
    "sampling": {
        "temperature": 1.0,
        "seed": seed
    }
} for seed in (7, 8, 9)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every case on the toy model, offline, in a process of its own."""
    folder = tmp_path_factory.mktemp("threadweaver")
    (folder / "cases.json").write_text(json.dumps(CASES))
    subprocess.run([
        sys.executable, "-m",
        "sequence_hooks_references.formats.run_threadweaver",
        str(MODEL), folder / "cases.json", folder / "out.json"
    ],
                   check=True,
                   timeout=1200)
    return {
        case["name"]: case
        for case in json.loads((folder / "out.json").read_text())
    }


def test_on_the_toy_model_every_fork_follows_the_rules(runs):
    for name in ("greedy", "window", "cap"):
        for prompt, [out] in zip(PROMPTS, runs[name]["rollouts"]):
            check_rollout(ids(prompt), out)
    greedy = [out for [out] in runs["greedy"]["rollouts"]]
    assert any(
        len(out["forks"][0]["branches"]) > 1 for out in greedy if out["forks"])
    window = [out for [out] in runs["window"]["rollouts"]]
    assert any(b["finish_reason"] == "length" for out in window
               for f in out["forks"] for b in f["branches"])
    assert {out["ended"]
            for [out] in runs["cap"]["rollouts"]
            } <= {"max_iterations", "eos", "length", "thread_ended"}


def test_on_the_toy_model_the_step_cap_stops_where_it_is(runs):
    capped = [out for [out] in runs["cap"]["rollouts"]]
    greedy = [out for [out] in runs["greedy"]["rollouts"]]
    assert any(out["ended"] == "max_iterations" for out in capped)
    for cut, out in zip(capped, greedy):
        assert out["token_ids"][:len(cut["token_ids"])] == cut["token_ids"]


def test_on_the_toy_model_seeded_samples_are_seeded_as_vllm_seeds_n(runs):
    """Sample i's first call samples what stock vLLM's sample i of one
    request with ``n`` does (vLLM seeds it ``seed + i``), and each sample
    answers as a request of that seed alone."""
    [stock] = runs["seeded"]["stock_n"]
    assert stock["first_calls"] == stock["stock"]
    assert len({tuple(ids) for ids in stock["stock"]}) > 1
    [samples] = runs["seeded"]["rollouts"]
    alone = [runs[f"seed {seed}"]["rollouts"][0][0] for seed in (7, 8, 9)]
    assert [s["token_ids"] for s in samples] == [a["token_ids"] for a in alone]


def test_over_http_to_stock_vllm_serve_it_gives_the_offline_answers(
        runs, tmp_path):
    with toy_server(MODEL, tmp_path / "server.log") as url:
        backend = HTTPBackend(url)
        rollouts = run(ThreadWeaverController(TOKENIZER, max_tokens=160),
                       backend, [ids(p) for p in PROMPTS[:8]])
    for [rollout], [offline] in zip(rollouts, runs["greedy"]["rollouts"]):
        assert dataclasses.asdict(rollout) == offline
    assert backend.requests == sum(r.calls for [r] in rollouts)
