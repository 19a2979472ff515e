# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fuzzed format inputs through a served engine: each format's toy model
behind `vllm serve --special-kwargs '{"format": ...}'` (the suite's
shared server of the format, which the in-engine tests' API cases use
too; NPR's and Multiverse's with KV blocks of 32 tokens, so that paths
start inside blocks), sent a batch of odd requests at once: prompts
with the format's
tags inside them, tags cut short, non-ASCII text, values of another
type where the format has a list, prompts that push the toy off its
format, more labels than a splice format forks, repeated, unknown and
huge labels, and outputs forced odd where the server allows it
(`logit_bias` toward a tag, an EOS or a BOS; budgets of one and a few
tokens, budgets ending in a block's paths and at its join; stop strings
and stop ids; seeded samples).

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
- an NPR or Multiverse answer (stop strings included) carries its tree:
  the root's tokens are the answer's; each block forked at its goal's
  closing tag one path a label its goal lists (1 to 5), nested only in
  Multiverse; after the goal the answer holds the newline, each path's
  header and tokens and the closing text, or ends there (its budget, a
  path that did not close). The first goal closing tag that forked
  nothing, where the layout reads it, lists there no label or more than
  5 (or its paths would not fit the window). A greedy,
  unbiased answer is the layout's (the reference of
  test_formats_splice_in_engine.py): every token the model sampled,
  root and paths, is the argmax of one forward of the toy over the
  answer's final sequence with the layout's 4-D mask and positions
  (`layout_check.greedy_mismatches`), the whole answer but where an ask
  says why the layout stops describing it (the toy writing a path's
  tag out of any block, past which the engine and the layout part);
- after the batch, nothing held: no request running or waiting, no KV
  block used, no child running, no parent parked (`assert_idle`, which
  fails on a metric missing from /metrics); then the server answers a
  search that forks.

The servers take more children a fork than their defaults
(`toy_server.CHILD_LIMITS`), so that a prompt with many labels forks each
one, as the controllers do.
"""

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sequence_hooks_references.formats import apr_trace
from sequence_hooks_references.formats import threadweaver_controller as tw
from sequence_hooks_references.formats.backends import ScriptedBackend
from sequence_hooks_references.layout_check import greedy_mismatches
from sequence_hooks_references.parallel_layout import FORMATS as LAYOUTS
from sequence_hooks_references.parallel_layout import (LayoutTags, forced_mask,
                                                       parallel_layout,
                                                       parse_layout)
from sequence_hooks_testkit.formats.toy_server import (FORMAT_TOYS, choices,
                                                       held_out_prompts)
from sequence_hooks_testkit.v1_server import assert_idle

# The shared servers its tests use (conftest's `shared_servers`).
pytestmark = pytest.mark.shares("threadweaver toy", "apr toy", "npr toy",
                                "multiverse toy")

REQUEST_TIMEOUT_S = 300
IDLE_TIMEOUT_S = 120
IN_FLIGHT = 8
# The toys' folders and context windows (APR's searches are longer).
TW_TOY, TW_WINDOW, _ = FORMAT_TOYS["threadweaver"]
APR_TOY, APR_WINDOW, _ = FORMAT_TOYS["apr"]
NPR_TOY, NPR_WINDOW, _ = FORMAT_TOYS["npr"]
MULTIVERSE_TOY, MULTIVERSE_WINDOW, _ = FORMAT_TOYS["multiverse"]


@dataclass(frozen=True)
class Ask:
    """One request: its name, its prompt, what it sets beside the plain
    greedy request, what a refusal's reason says (None: answered) and,
    for a splice format, why its reference reads only part of it."""

    name: str
    prompt: Any
    change: dict = field(default_factory=dict)
    refused: Optional[str] = None
    # A splice format's greedy ask: why the layout reads only part of its
    # answer (None: it reads it whole).
    partly: Optional[str] = None


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
    # The splice formats' reference: the toy's checkpoint in transformers
    # (None for the other formats).
    reference: Any = None

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
        Ask("stop ids of its own", many, {
            "stop_token_ids": tokenizer.encode(":*", add_special_tokens=False)
        }),
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


def bias(tokenizer, **by_token: float) -> dict:
    """A `logit_bias` by token (``eos``: the EOS)."""
    ids = {
        token:
        tokenizer.eos_token_id
        if token == "eos" else tokenizer.convert_tokens_to_ids(token)
        for token in by_token
    }
    return {
        "logit_bias": {
            str(ids[token]): value
            for token, value in by_token.items()
        }
    }


def open_goal(opening: str, entry: str, entry_close: str,
              entries: list[tuple[str, str]]) -> str:
    """A block's goal left open: ``opening``, then an entry
    ``{label}: {word}`` a line."""
    return opening + "".join(f"{entry}{label}: {word}{entry_close}\n"
                             for label, word in entries)


# A block the toys' tasks write, as text inside a prompt.
NPR_BLOCK = (
    "<guideline>\n<plan>1: ox</plan>\n</guideline>\n<step>\n1: ox = o "
    "x so x\n</step>\n<takeaway>\n1: x\n</takeaway>\nanswer x\n")
MULTIVERSE_BLOCK = ("<Parallel>\n<Goal>\n<Outline>1: ox</Outline>\n</Goal>\n"
                    "<Path>\n1: ox = o x so x\n</Path>\n<Conclusion>\n1: x\n"
                    "</Conclusion>\n</Parallel>\nanswer x\n")
# Six of the toys' words, labelled 1 to 6.
SIX = [
    (str(i), word)
    for i, word in enumerate(("cat", "lamp", "star", "sky", "dog", "owl"), 1)
]
HUGE = "9" * 30
# Why the layout reads only part of an answer (`assert_splice_as_the_layout`).
OFF_FORMAT = ("the toy leaves its format: a path's tag out of any block it "
              "opened")


def label_asks(tokenizer, goal: Callable[[str, list[tuple[str, str]]],
                                         str], entries: str, goal_close: str,
               path_close_bias: tuple[str, float]) -> list[Ask]:
    """A splice format's asks of odd labels: a prompt ending in a goal
    left open (``goal(words, [(label, word), ...])``) with a repeated
    label, unknown labels, a huge label, five ``entries`` (its closing
    tag and the paths' closers forced: five paths) and six (its closing
    tag forced: no fork).

    Args:
        tokenizer: The toy's tokenizer.
        goal: Writes the prompt.
        entries: What the format calls a goal's entries.
        goal_close: The goal's closing tag.
        path_close_bias: A path's closing tag and its bias.
    """
    path_close, path_bias = path_close_bias
    return [
        Ask("a repeated label", goal("cat dog", [("1", "cat"), ("1", "dog")])),
        Ask("unknown labels",
            goal("cat dog ox", [("0", "cat"), ("2.7.1", "dog"), ("x", "ox")])),
        Ask("a huge number label",
            goal("cat dog", [(HUGE, "cat")]),
            partly=OFF_FORMAT),
        Ask(
            f"five {entries}, {goal_close} and {path_close} forced",
            goal("cat lamp star sky dog", SIX[:5]), {
                "max_tokens": 150,
                **bias(tokenizer, **{
                    goal_close: 100,
                    path_close: path_bias
                })
            }),
        Ask(f"six {entries}, {goal_close} forced: no fork",
            goal("cat lamp star sky dog owl", SIX), {
                "max_tokens": 30,
                **bias(tokenizer, **{goal_close: 100})
            }),
    ]


def npr_asks(tokenizer) -> list[Ask]:
    """NPR's odd requests, from the toy's first held-out prompt
    (``"cat lamp star sky\\n"``: a guideline of four plans, closed at the
    answer's 31st token, whose steps' join is 91 tokens long)."""
    plain = held_out_prompts(NPR_TOY, 1)[0]

    def guideline(words: str, entries: list[tuple[str, str]]) -> str:
        return words + "\n" + open_goal("<guideline>\n", "<plan>", "</plan>",
                                        entries)

    return [
        Ask("plain", plain),
        Ask("a block inside the prompt", NPR_BLOCK + plain, partly=OFF_FORMAT),
        Ask("a guideline open at the prompt's end",
            guideline("cat dog", SIX[:1])),
        Ask("the prompt ends in a step",
            guideline("cat dog", SIX[:1]) + "</guideline>\n<step>\n1:",
            partly="the engine computed the prompt's step as plain text: "
            "its </step> closes no path"),
        Ask("closers out of place",
            "</step></guideline></takeaway></plan><step>" + plain),
        Ask("tags cut short", "<guideline\n<plan 1: cat</pla\n" + plain),
        Ask("a plan cut short at the prompt's end",
            "cat dog\n<guideline>\n<plan>1"),
        Ask("non-ASCII", "é 中文 🙂 " + plain),
        *label_asks(tokenizer, guideline, "plans", "</guideline>",
                    ("</step>", 95)),
        Ask("</guideline> forced", plain,
            bias(tokenizer, **{"</guideline>": 100})),
        Ask("</guideline> pushed", plain,
            bias(tokenizer, **{"</guideline>": 10})),
        Ask("</step> pushed", plain, bias(tokenizer, **{"</step>": 10})),
        Ask(
            "</guideline> and </step> forced", guideline("cat dog", SIX[:2]), {
                "max_tokens": 80,
                **bias(tokenizer, **{
                    "</guideline>": 100,
                    "</step>": 100
                })
            }),
        Ask("EOS forced", plain, bias(tokenizer, eos=100)),
        Ask("EOS pushed", guideline("cat dog", SIX[:2]), bias(tokenizer,
                                                              eos=10)),
        Ask("a budget of one", plain, {"max_tokens": 1}),
        Ask("a budget of three, </guideline> forced", plain, {
            "max_tokens": 3,
            **bias(tokenizer, **{"</guideline>": 100})
        }),
        Ask("a budget ending in the steps", plain, {"max_tokens": 40}),
        Ask("a budget ending with the join", plain, {"max_tokens": 122}),
        Ask("a budget one past the join", plain, {"max_tokens": 123}),
        Ask("seeded samples", plain, {
            "temperature": 1.0,
            "seed": 7,
            "n": 2
        }),
        Ask("a stop string in the steps", plain, {"stop": ["so"]}),
        Ask("a stop string at a step's end", plain, {"stop": ["\n\n"]}),
        Ask("a stop string in a join", plain, {"stop": ["so", "\n\n"]}),
        Ask(
            "stop ids", plain, {
                "stop_token_ids":
                tokenizer.convert_tokens_to_ids(["</step>", "</takeaway>"])
            }),
        *refused_asks(tokenizer, plain),
    ]


def multiverse_asks(tokenizer) -> list[Ask]:
    """Multiverse's odd requests, from its toy's fourth held-out prompt
    (``"bird+sun fish\\n"``: a block of two paths, closed at the answer's
    21st token, the first path nesting a block of its own; the outer
    join is 135 tokens long)."""
    plain = held_out_prompts(MULTIVERSE_TOY, 4)[3]

    def outlines(words: str, entries: list[tuple[str, str]]) -> str:
        return words + "\n" + open_goal("<Parallel>\n<Goal>\n", "<Outline>",
                                        "</Outline>", entries)

    return [
        Ask("plain", plain),
        Ask("a block inside the prompt",
            MULTIVERSE_BLOCK + plain,
            partly=OFF_FORMAT),
        Ask("a goal open at the prompt's end",
            outlines("bird+sun fish", [("1", "bird+sun")])),
        Ask("a nested goal open at the prompt's end",
            outlines("bird+sun fish", [("1", "bird+sun"), ("2", "fish")]) +
            "</Goal>\n<Path>\n1: bird+sun\n" +
            open_goal("<Parallel>\n<Goal>\n", "<Outline>", "</Outline>",
                      [("1.1", "bird")]),
            partly="the engine computed the prompt's outer path as plain "
            "text: its </Path> closes no path"),
        Ask("the prompt ends in a path",
            outlines("cat dog", SIX[:2]) + "</Goal>\n<Path>\n1:",
            partly="the engine computed the prompt's path as plain text: "
            "its </Path> closes no path"),
        Ask("a goal with no <Parallel>",
            "cat dog\n<Goal>\n<Outline>1: cat</Outline>\n",
            partly="its goal opens no block: the engine forks at its </Goal> "
            "(the labels after the last <Goal>), the layout reads none"),
        Ask("closers out of place",
            "</Path></Goal></Conclusion></Parallel><Path>" + plain,
            partly=OFF_FORMAT),
        Ask("tags cut short",
            "<Paral\n<Goal\n<Outline 1: x</Outl\n" + plain,
            partly=OFF_FORMAT),
        Ask("an outline cut short at the prompt's end",
            "cat dog\n<Parallel>\n<Goal>\n<Outline>1"),
        Ask("non-ASCII", "é 中文 🙂 " + plain),
        *label_asks(tokenizer, outlines, "outlines", "</Goal>",
                    ("</Path>", 100)),
        Ask("</Goal> forced", plain, bias(tokenizer, **{"</Goal>": 100})),
        Ask("</Goal> pushed", plain, bias(tokenizer, **{"</Goal>": 10})),
        Ask("</Path> pushed", plain, bias(tokenizer, **{"</Path>": 10})),
        Ask("</Path> pushed after an open goal", outlines("cat dog", SIX[:2]),
            {
                "max_tokens": 80,
                **bias(tokenizer, **{"</Path>": 15})
            }),
        Ask("EOS forced", plain, bias(tokenizer, eos=100)),
        Ask("EOS pushed", outlines("cat dog", SIX[:2]), bias(tokenizer,
                                                             eos=10)),
        Ask("a budget of one", plain, {"max_tokens": 1}),
        Ask("a budget of three, </Goal> forced", plain, {
            "max_tokens": 3,
            **bias(tokenizer, **{"</Goal>": 100})
        }),
        Ask("a budget ending in a nested header", plain, {"max_tokens": 60}),
        Ask("a budget ending in a nested path", plain, {"max_tokens": 66}),
        Ask("a budget ending with the join", plain, {"max_tokens": 156}),
        Ask("a budget one past the join", plain, {"max_tokens": 157}),
        Ask("seeded samples", plain, {
            "temperature": 1.0,
            "seed": 7,
            "n": 2
        }),
        Ask("a stop string in the paths", plain, {"stop": ["so"]}),
        Ask("a stop string at a nested path's end", plain,
            {"stop": ["d\n\n"]}),
        Ask("a stop string in a join", plain, {"stop": ["so", "h\n\n"]}),
        Ask(
            "stop ids", plain, {
                "stop_token_ids":
                tokenizer.convert_tokens_to_ids(["</Path>", "</Conclusion>"])
            }),
        *refused_asks(tokenizer, plain),
    ]


FORMATS = {
    "threadweaver": (TW_TOY, TW_WINDOW, tw_asks),
    "apr": (APR_TOY, APR_WINDOW, apr_asks),
    "npr": (NPR_TOY, NPR_WINDOW, npr_asks),
    "multiverse": (MULTIVERSE_TOY, MULTIVERSE_WINDOW, multiverse_asks),
}
# The formats whose join splices the paths' KV: their reference is the
# layout's (test_formats_splice_in_engine.py).
SPLICE = ("npr", "multiverse")


@pytest.fixture(scope="module", params=list(FORMATS))
def served(request, shared_servers) -> Served:
    """The suite's shared server of the format's toy
    (`toy_server.start_format_server`, with `CHILD_LIMITS`); a splice
    format's with the toy's checkpoint as its reference."""
    name = request.param
    model, window, _ = FORMATS[name]
    reference = None
    if name in SPLICE:
        reference = AutoModelForCausalLM.from_pretrained(
            model, dtype=torch.float32, attn_implementation="eager")
    server = shared_servers.get(f"{name} toy")
    served = Served(name, server.url, model, window,
                    AutoTokenizer.from_pretrained(model), server.log,
                    reference)
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
    body = served.body(ask)
    [[rollout]] = tw.run(
        tw.ThreadWeaverController(tokenizer,
                                  response_length=body["max_tokens"]),
        ScriptedBackend(lambda context: sampled.get(tuple(context), pad),
                        tokenizer.eos_token_id, served.window), [prompt], {
                            "temperature": 0.0,
                            "stop_token_ids": body.get("stop_token_ids", [])
                        })
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


def paths_by_fork(node: dict) -> dict[int, list[dict]]:
    """A tree node's blocks: its paths by their fork position, in
    order."""
    blocks: dict[int, list[dict]] = {}
    for child in node["children"]:
        blocks.setdefault(child["fork_position"], []).append(child)
    return blocks


def encode(served: Served, text: str) -> list[int]:
    """``text``'s ids in the served toy's tokenizer, none added."""
    return served.tokenizer.encode(text, add_special_tokens=False)


def assert_splice_tree_well_formed(served: Served, ask: Ask, choice: dict,
                                   tree: Optional[dict]) -> None:
    """The answer's tree as the format builds it, whatever was sampled:
    the root's tokens are the answer's; every node ended by "stop" or
    "length"; every block forked at its goal's closing tag, one path a
    label its goal lists (the format's regex over the node's context:
    prompt, parents and own tokens), in order, 1 to 5 of them, nested
    only where the format nests; and a node's tokens after a goal hold
    the newline, then each path's header and tokens, then the closing
    text if every path closed, or end the answer there (at its budget,
    or after the first path that did not close)."""
    if tree is None:
        return
    fmt = LAYOUTS[served.name]
    tags = fmt.tags(served.tokenizer)
    after = encode(served, fmt.after_text())

    def walk(node: dict, before: list[int]) -> None:
        own = node["token_ids"]
        assert node["finish_reason"] in ("stop", "length"), ask.name
        blocks = paths_by_fork(node)
        assert fmt.nests or node["depth"] == 0 or not blocks, ask.name
        for fork, paths in blocks.items():
            assert own[fork - 1] == tags.goal_close, ask.name
            labels = fmt.labels(served.tokenizer.decode(before + own[:fork]))
            assert [path["label"] for path in paths] == labels, ask.name
            assert len(paths) <= fmt.max_paths, ask.name
            joined = [tags.newline]
            for path in paths:
                assert path["depth"] == node["depth"] + 1, ask.name
                header = encode(served, fmt.header(path["label"]))
                walk(path, before + own[:fork] + [tags.newline] + header)
                joined += header + path["token_ids"]
                if path["token_ids"][-2:] != [tags.path_close, tags.newline]:
                    break
            else:
                joined += after
            shown = own[fork:fork + len(joined)]
            assert shown == joined[:len(shown)], ask.name
            assert (len(shown) == len(joined)
                    or fork + len(shown) == len(own)), ask.name

    # A stop string the join's tokens complete cuts the answer: its tree
    # must be cut there too.
    assert tree["token_ids"] == choice["token_ids"], (
        ask.name, "the tree's root is not the answer",
        served.tokenizer.decode(tree["token_ids"]))
    walk(tree, choice["prompt_token_ids"])


def forked_goals(served: Served, tree: Optional[dict],
                 prompt_len: int) -> set[int]:
    """The indexes, in the answer's final sequence (prompt first), of the
    goal closing tags that forked."""
    fmt = LAYOUTS[served.name]
    found: set[int] = set()

    def place(node: dict, offset: int) -> None:
        for fork, paths in paths_by_fork(node).items():
            found.add(offset + fork - 1)
            cursor = offset + fork + 1
            for path in paths:
                header = encode(served, fmt.header(path["label"]))
                place(path, cursor + len(header))
                cursor += len(header) + len(path["token_ids"])

    if tree is not None:
        place(tree, prompt_len)
    return found


def layout_start(prompt: list[int], tags: LayoutTags) -> int:
    """Where the layout reads a prompt from: its end (the engine computes
    a prompt as plain text, whatever tags it holds), or the last block it
    opens if that block's goal is still open at its end (the engine reads
    that goal's labels)."""
    opens = [i for i, token in enumerate(prompt) if token == tags.block_open]
    if opens:
        try:
            layout = parse_layout(prompt, tags, opens[-1], allow_open=True)
        except ValueError:
            return len(prompt)
        if layout.blocks[-1].state == "goal":
            return opens[-1]
    return len(prompt)


@dataclass(frozen=True)
class Reach:
    """How far the layout describes an answer: where it reads the prompt
    from (`layout_start`), where the prefix it reads ends (prompt
    included), and which tokens of it the engine forced."""

    start: int
    end: int
    forced: list[bool]


def assert_splice_forks_as_the_layout(served: Served, ask: Ask, choice: dict,
                                      tree: Optional[dict]) -> Reach:
    """The layout's reach in the answer (prompt first): up to the first
    token it cannot read (a path's tag out of any block, a block in an
    NPR path), or to the first goal closing tag that forked nothing,
    included, where the layout's rule forks nothing either (its goal, as
    the token sees it, lists no label or more than 5, or the paths would
    not fit the window). Past that tag the engine decodes on in plain
    positions, where the layout would place a block the model writes on
    itself. A cut answer's open block is read open."""
    fmt = LAYOUTS[served.name]
    tags = fmt.tags(served.tokenizer)
    prompt = choice["prompt_token_ids"]
    ids = prompt + choice["token_ids"]
    start = layout_start(prompt, tags)
    forked = forked_goals(served, tree, len(prompt))
    unforked = [
        i for i in range(len(prompt), len(ids))
        if ids[i] == tags.goal_close and i not in forked
    ]
    end = unforked[0] + 1 if unforked else len(ids)
    while True:
        try:
            forced = forced_mask(ids[:end], len(prompt), tags, start)
            break
        except ValueError:
            end -= 1
    if unforked and end == unforked[0] + 1:
        layout = parse_layout(ids[:end], tags, start, allow_open=True)
        unseen = {
            k
            for later, earlier in layout.hidden_pairs() if end - 1 in later
            for k in earlier
        }
        context = [ids[k] for k in range(end) if k not in unseen]
        labels = fmt.labels(served.tokenizer.decode(context))
        fits = all(
            len(context) + 1 +
            len(encode(served, fmt.header(label))) < served.window
            for label in labels)
        assert not (1 <= len(labels) <= fmt.max_paths and fits), (ask.name,
                                                                  "no fork",
                                                                  labels)
    return Reach(start, end, forced)


def assert_splice_as_the_layout(served: Served, ask: Ask, choice: dict,
                                reach: Reach) -> None:
    """Every token the model sampled, root and paths, up to the layout's
    reach, is the argmax of one forward of the toy over the answer's
    final sequence under the layout (`greedy_mismatches`, as
    test_formats_splice_in_engine.py checks the held-out answers); the
    whole answer (but a header its budget cut short, which the engine
    forced) unless the ask says why not."""
    tags = LAYOUTS[served.name].tags(served.tokenizer)
    prompt = choice["prompt_token_ids"]
    ids = prompt + choice["token_ids"]
    # Whole: up to a path's header the budget cut short (forced tokens).
    rest = ids[reach.end:]
    assert ask.partly is not None or not rest or (
        rest[0] == tags.path_open and tags.header_end not in rest), (ask.name,
                                                                     reach.end)

    def layout(token_ids, layout_tags, allow_open=False, dtype=None):
        return parallel_layout(token_ids,
                               layout_tags,
                               reach.start,
                               allow_open=True,
                               dtype=dtype)

    assert greedy_mismatches(served.reference,
                             ids[:reach.end],
                             len(prompt),
                             tags,
                             reach.forced,
                             layout=layout) == [], ask.name


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
            if "stop" in ask.change and served.name not in SPLICE:
                continue
            if served.name in SPLICE:
                assert_splice_tree_well_formed(served, ask, choice, tree)
                reach = assert_splice_forks_as_the_layout(
                    served, ask, choice, tree)
                if not {"logit_bias", "temperature"} & ask.change.keys():
                    assert_splice_as_the_layout(served, ask, choice, reach)
            elif served.name == "threadweaver":
                assert_threadweaver_as_the_controller(served, ask, choice,
                                                      tree)
            else:
                assert_apr_as_the_reference(served, ask, choice, tree)
    assert_idle(served.url, IDLE_TIMEOUT_S)
    assert requests.get(served.url + "/health", timeout=10).status_code == 200
    assert_forks(served)
