# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A format added from outside the package, as docs/formats.md ("Adding
a format") tells a user to: defined in this file alone, registered
through the public API (an entry point of group
``sequence_hooks.formats``, declared by a distribution this test
installs on the path of the processes it starts), and served in-engine
by the V1 plugin with no change to it, offline (`LLM(...,
special_kwargs=)`) and over `vllm serve`, its tree in the answer.

The format, ``outline_join``: at `</Outlines>` one thread per numbered
`<Outline>`, each from ``"\\n<Thread>\\n{label}:"`` to `</Thread>` or
EOS; the join appends the threads, each under its header, and ``"\\n"``;
a thread that ends without `</Thread>` ends the answer after the join.
Where every thread ends at `</Thread>` that is ThreadWeaver's join, so on
models/threadweaver-toy the two formats answer alike there, which the
test checks against the built-in format (served the same way).
"""

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sequence_hooks import Format
from sequence_hooks.fork_join import (NEEDS, Branch, BranchResult,
                                      ForkJoinPolicy, Joined)
from sequence_hooks_testkit.formats.threadweaver_toy import MODEL
from sequence_hooks_testkit.formats.toy_server import (choices,
                                                       held_out_prompts,
                                                       toy_server)
from sequence_hooks_training import threadweaver_task as task_mod

NAME = "outline_join"
LABEL = re.compile(r"<Outline>\s*([0-9]+)\s*:")


@dataclass(frozen=True)
class OutlineJoin:
    """The format for one tokenizer (a `fork_join.ForkJoinFormat`)."""

    tokenizer: Any
    outlines_id: int
    trigger_id: int
    thread_end_id: int
    max_steps: int = 64

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def header(self, label: str, first: bool) -> tuple[int, ...]:
        return self.encode(("\n" if first else "") + f"<Thread>\n{label}:")

    def branches(self, context: Sequence[int]) -> list[Branch]:
        ids = list(context)
        if self.outlines_id not in ids:
            return []
        start = len(ids) - 1 - ids[::-1].index(self.outlines_id)
        text = self.tokenizer.decode(ids[start:])
        labels = dict.fromkeys(LABEL.findall(text))
        stops = (self.thread_end_id, self.tokenizer.eos_token_id)
        return [
            Branch(label, self.header(label, True), stops) for label in labels
        ]

    def join(self, results: Sequence[BranchResult]) -> Joined:
        token_ids: list[int] = []
        for i, result in enumerate(results):
            own = [
                t for t in result.token_ids if t != self.tokenizer.eos_token_id
            ]
            token_ids += [*self.header(result.label, i == 0), *own]
        final = any(
            not result.token_ids or result.token_ids[-1] != self.thread_end_id
            for result in results)
        return Joined(tuple(token_ids) + self.encode("\n"), final)


def _policy(coordinator, setting) -> ForkJoinPolicy:
    tags = setting.tags
    ids = {
        role: setting.tokenizer.convert_tokens_to_ids(tag)
        for role, tag in tags.items()
    }
    return ForkJoinPolicy(
        coordinator,
        OutlineJoin(setting.tokenizer, ids["outlines"], ids["trigger"],
                    ids["thread_end"]))


FORMAT = Format(name=NAME,
                policy=_policy,
                needs=NEEDS,
                tags={
                    "outlines": "<Outlines>",
                    "trigger": "</Outlines>",
                    "thread_end": "</Thread>"
                },
                summary="outlines fork threads, joined under their headers")

TOKENIZER = task_mod.build_tokenizer()
PROMPTS = held_out_prompts(MODEL, 8)


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a process that has this file's format
    installed: a distribution declaring its entry point, on the path."""
    site = tmp_path_factory.mktemp("site")
    info = site / "outline_join_example-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\n"
                                   "Name: outline-join-example\n"
                                   "Version: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[sequence_hooks.formats]\n{NAME} = {Path(__file__).stem}:FORMAT\n")
    path = [str(site), str(Path(__file__).parent)]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


def in_engine(fmt: str, env: dict, folder: Path) -> list[dict]:
    """The greedy answers of `LLM(..., special_kwargs={"format": fmt})`
    to the prompts, in a process of its own (the window's budget)."""
    cases = folder / "cases.json"
    cases.write_text(
        json.dumps([{
            "name": fmt,
            "prompts": PROMPTS,
            "max_tokens": None
        }]))
    subprocess.run([
        sys.executable, "-m", "sequence_hooks_testkit.formats.run_in_engine",
        str(MODEL), fmt, cases, folder / "out.json"
    ],
                   check=True,
                   timeout=1200,
                   env=env)
    return json.loads((folder / "out.json").read_text())[0]["answers"]


@pytest.fixture(scope="module")
def offline(plugin_env, tmp_path_factory) -> tuple[list, list]:
    """Each prompt's answer in the plug-in's format and in ThreadWeaver's."""
    return (in_engine(NAME, plugin_env, tmp_path_factory.mktemp(NAME)),
            in_engine("threadweaver", plugin_env,
                      tmp_path_factory.mktemp("threadweaver")))


def expected_join(children: list[dict]) -> list[int]:
    """The format's join of a fork's children, as its tree records them."""
    fmt = OutlineJoin(
        TOKENIZER,
        *TOKENIZER.convert_tokens_to_ids(
            ["<Outlines>", "</Outlines>", "</Thread>"]))
    results = [
        BranchResult(c["label"], tuple(c["token_ids"]), c["finish_reason"])
        for c in children
    ]
    return list(fmt.join(results).token_ids)


def assert_answer_in_format(answer: dict) -> int:
    """An answer's tree: each fork's threads are the outlines' labels
    before it, and the answer holds each join where the tree says it
    fell. Returns its number of threads."""
    tree = answer["tree"]
    if tree is None:
        return 0
    token_ids = answer["token_ids"]
    children = tree["children"]
    forks: dict[int, list[dict]] = {}
    for child in children:
        forks.setdefault(child["fork_position"], []).append(child)
    spans = tree["merged_spans"]
    assert len(spans) == len(forks)
    for (start, count), (position, threads) in zip(spans, forks.items()):
        assert start == position
        before = TOKENIZER.decode(token_ids[:position])
        outlines = before[before.rindex("<Outlines>"):]
        assert [t["label"] for t in threads
                ] == list(dict.fromkeys(LABEL.findall(outlines)))
        assert token_ids[start:start + count] == expected_join(threads)[:count]
    return len(children)


def test_a_format_from_outside_the_package_is_served_offline(offline):
    mine, _ = offline
    assert sum(assert_answer_in_format(answer) for answer in mine) > 0


def test_it_answers_as_threadweaver_where_their_joins_agree(offline):
    """Where every thread ended at `</Thread>`, the plug-in's join is
    ThreadWeaver's: the answers are the same token for token."""
    mine, threadweaver = offline
    agree = [
        (answer, theirs) for answer, theirs in zip(mine, threadweaver)
        if answer["tree"] is not None and answer["tree"]["children"] and all(
            c["token_ids"] and c["token_ids"][-1] ==
            TOKENIZER.convert_tokens_to_ids("</Thread>")
            for c in answer["tree"]["children"])
    ]
    assert agree
    for answer, theirs in agree:
        assert answer["token_ids"] == theirs["token_ids"]


def test_it_is_served_over_the_api_with_its_tree(offline, plugin_env,
                                                 tmp_path_factory,
                                                 monkeypatch):
    """`vllm serve --special-kwargs '{"format": "outline_join"}'`: the
    server's processes find the format by its entry point; each answer
    and its tree are the offline engine's."""
    mine, _ = offline
    monkeypatch.setenv("PYTHONPATH", plugin_env["PYTHONPATH"])
    with toy_server(MODEL,
                    tmp_path_factory.mktemp("served") / "server.log",
                    ("--special-kwargs", json.dumps({"format": NAME}))) as url:
        for prompt, want in zip(PROMPTS, mine, strict=True):
            prompt_ids = TOKENIZER.encode(prompt, add_special_tokens=False)
            got, answer = choices(
                url, "/v1/completions", {
                    "model": str(MODEL),
                    "prompt": prompt_ids,
                    "max_tokens": 512 - len(prompt_ids),
                    "temperature": 0.0,
                    "return_token_ids": True,
                })
            assert got[0]["token_ids"] == want["token_ids"]
            tree = (answer.get("kv_transfer_params") or {}).get("promise_tree")
            if want["tree"] is None:
                assert tree is None
                continue
            assert [(c["label"], c["token_ids"]) for c in tree["children"]
                    ] == [(c["label"], c["token_ids"])
                          for c in want["tree"]["children"]]
