# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Golden traces of the served formats, written by their controllers.

Each format's cases run its test-kit controller (`APRController`,
`ThreadWeaverController`: parsing, prompts and joins of their own, no
code of the engine's) over a scripted greedy model, model-free, and keep
every call it made (the prompt, its ids, the parameters, the ids sampled,
the completion) and its answer. The files are pinned in
common/tests/golden/ (``apr.json``, ``threadweaver.json``);
common/tests/test_formats_golden.py runs the engine's lifecycle on a
model that replays them (`Replay`) and checks that it makes the same
calls and gives the same answers. The tokenizers are the format tests'
(a character a token, the tags one token each; APR's also merges
``"]\\n"``), described in each file.

Usage (any venv with the references and the test kit): python -m
sequence_hooks_references.formats.golden [OUT_DIR] (common/tests/golden by
default).
"""

import argparse
import json
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from sequence_hooks_references.formats.apr_controller import (APRController,
                                                              run_apr)
from sequence_hooks_references.formats.backends import (Recorded,
                                                        ScriptedBackend,
                                                        ScriptedTextBackend)
from sequence_hooks_references.formats.threadweaver_controller import (
    ThreadWeaverController, run)
from sequence_hooks_testkit.formats import apr_scripts as apr

GOLDEN = Path(__file__).resolve().parents[3] / "common" / "tests" / "golden"


@dataclass(frozen=True)
class PieceTokenizer:
    """A tokenizer of whole pieces and characters: a piece (longest first)
    is one token, its index; any other character is ``offset`` plus its
    code point. The first ``special`` pieces are special tokens."""

    pieces: tuple[str, ...]
    special: int
    offset: int
    bos_token: Optional[str]
    eos_token_id: int

    def encode(self, text: str, add_special_tokens: bool = False) -> list:
        """``text``'s ids (nothing added, whatever ``add_special_tokens``:
        a BOS is sent as text)."""
        by_length = sorted(self.pieces, key=len, reverse=True)
        ids, at = [], 0
        while at < len(text):
            piece = next((p for p in by_length if text.startswith(p, at)),
                         None)
            if piece is None:
                ids.append(self.offset + ord(text[at]))
                at += 1
            else:
                ids.append(self.pieces.index(piece))
                at += len(piece)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens=False) -> str:
        """The text of ``ids``, special tokens left out if asked."""
        return "".join(
            self._piece(i) for i in ids
            if not (skip_special_tokens and i < self.special))

    def _piece(self, token_id: int) -> str:
        if token_id >= self.offset:
            return chr(token_id - self.offset)
        return self.pieces[token_id] if token_id < len(self.pieces) else ""

    def to_json(self) -> dict[str, Any]:
        """The tokenizer as the golden files describe it."""
        return {
            "pieces": list(self.pieces),
            "special": self.special,
            "offset": self.offset,
            "bos_token": self.bos_token,
            "eos_token_id": self.eos_token_id,
        }


APR_TOKENIZER = PieceTokenizer(
    ("<s>", "</s>", "<End Calling Sub Searches>", "<Calling Sub Searches>",
     "<End Sub Searches>", "<Sub Searches>", "]\n"), 2, 100, "<s>", 1)
TW_TAGS = ("<Think>", "</Think>", "<Parallel>", "</Parallel>", "<Outlines>",
           "</Outlines>", "<Outline>", "</Outline>", "<Thread>", "</Thread>",
           "<Conclusion>", "</Conclusion>", "<eos>")
TW_TOKENIZER = PieceTokenizer(TW_TAGS, 0, 100, None, TW_TAGS.index("<eos>"))

# The model's cue that a join happened.
JOINED = "<End Sub Searches>\n"


@dataclass
class ScriptedSearch:
    """An APR model: greedy decoding of fixed texts. A context's text
    (special tokens left out) that begins one of ``scripts`` goes on with
    it; after k joins (the text holds `JOINED` k times) the text after the
    last goes on with ``after[k - 1]``. At a text's end, or off every
    text: EOS."""

    scripts: list[str]
    after: list[str] = field(default_factory=list)

    def next_token(self, context: list[int]) -> int:
        """The context's next token."""
        text = APR_TOKENIZER.decode(context, skip_special_tokens=True)
        candidates = self.scripts
        joins = text.count(JOINED)
        if joins:
            base = text[:text.rindex(JOINED) + len(JOINED)]
            candidates = [base + a for a in self.after[joins - 1:joins]]
        for script in candidates:
            if script.startswith(text) and script != text:
                return APR_TOKENIZER.encode(script[len(text):])[0]
        return APR_TOKENIZER.eos_token_id


@dataclass
class ScriptedThreads:
    """A ThreadWeaver model: greedy decoding of fixed scripts. In an open
    thread (a `<Thread>` after the response's last `</Thread>`) it writes
    its label's script after the header; elsewhere the root's script,
    read against the response with every joined thread (and a newline
    before it) left out. Off its script or at its end: EOS."""

    prompt_len: int
    root: str
    threads: dict[str, str] = field(default_factory=dict)

    def next_token(self, context: list[int]) -> int:
        """The context's next token."""
        text = TW_TOKENIZER.decode(context[self.prompt_len:])
        opened, closed = text.rfind("<Thread>"), text.rfind("</Thread>")
        if opened > closed:
            label, written = text[opened:].split(":", 1)
            script = self.threads[label[len("<Thread>\n"):]]
        else:
            script = self.root
            written = re.sub(r"\n?<Thread>.*?</Thread>",
                             "",
                             text,
                             flags=re.DOTALL)
        if not script.startswith(written) or script == written:
            return TW_TOKENIZER.eos_token_id
        return TW_TOKENIZER.encode(script[len(written):])[0]


def apr_case(name: str,
             scripts: list[str],
             after: Sequence[str] = (),
             root: str = apr.ROOT,
             max_tokens: int = 400) -> dict[str, Any]:
    """One search of `APRController` on a `ScriptedSearch`, and its
    calls."""
    backend = Recorded(
        ScriptedTextBackend(
            ScriptedSearch(scripts, list(after)).next_token, APR_TOKENIZER))
    [out] = run_apr(APRController(APR_TOKENIZER.bos_token, max_tokens),
                    backend, [root])
    calls = [
        dict(prompt=prompt,
             prompt_ids=APR_TOKENIZER.encode(prompt),
             params=params,
             token_ids=done.token_ids,
             text=done.text,
             finish_reason=done.finish_reason,
             stop_reason=done.stop_reason)
        for prompt, params, done in backend.calls
    ]
    return dict(name=name,
                root=root,
                max_tokens=max_tokens,
                model=dict(scripts=scripts, after=list(after)),
                calls=calls,
                trace=out.trace,
                answer=out.answer,
                rounds=out.rounds,
                error=out.error)


def apr_cases() -> list[dict[str, Any]]:
    """APR's golden cases."""
    one_round = [
        apr.ROOT + apr.CALL, apr.CHILD_0 + apr.FAILS, apr.CHILD_1 + apr.WINS
    ]
    long_search = "\n" + "Exploring Operation: 51+11=62\n" * 12 + apr.WINS
    nested = ("\nExploring Operation: 51-11=40, Resulting Numbers: [49, 40]"
              "\nGenerated Node #0,1,0: 39:[49, 40] Operation: 51-11=40\n"
              "<Calling Sub Searches>\n<Start Sub Search 0 at level 1> "
              "Moving to Node #0,1,0\n<End Calling Sub Searches>\n")
    unknown = (apr.GENERATED + "<Calling Sub Searches>\n<Start Sub Search 0 "
               "at level 1> Moving to Node #0,7\n<End Calling Sub Searches>\n")
    newline_root = apr.ROOT + "\n"
    return [
        apr_case("one round", one_round, [apr.CONCLUDES]),
        apr_case("the model writes the stop string", [
            apr.ROOT + apr.GENERATED + "<Sub Searches>\n" + apr.LISTED,
            *one_round
        ], [apr.CONCLUDES]),
        apr_case("two rounds", [
            apr.ROOT + apr.CALL, apr.CHILD_0 + apr.FAILS,
            apr.CHILD_1 + apr.FAILS, apr.GRANDCHILD_0 + apr.WINS,
            apr.GRANDCHILD_1 + apr.FAILS
        ], [apr.SECOND_CALL, apr.CONCLUDES],
                 max_tokens=800),
        apr_case("a sub-search cut at max_tokens", [
            apr.ROOT + apr.CALL, apr.CHILD_0 + apr.FAILS,
            apr.CHILD_1 + long_search
        ], [apr.CONCLUDES],
                 max_tokens=len(APR_TOKENIZER.encode(apr.CALL)) + 2),
        apr_case("a call listing no node", [
            apr.ROOT + apr.GENERATED +
            "<Calling Sub Searches>\n<End Calling Sub Searches>\n"
        ], ["No solution found.\n"]),
        apr_case("a call of a node the trace never made",
                 [apr.ROOT + unknown]),
        apr_case("a sub-search's own call is not read", [
            apr.ROOT + apr.CALL, apr.CHILD_0 + apr.FAILS, apr.CHILD_1 + nested
        ], ["No solution found.\n"]),
        apr_case("a root prompt ending in a newline", [
            newline_root + apr.CALL[1:], apr.CHILD_0 + apr.FAILS,
            apr.CHILD_1 + apr.WINS
        ], [apr.CONCLUDES],
                 root=newline_root),
    ]


TW_PROMPT = "Q: 2*3*4?\n"
OUTLINES = ("<Parallel>\n<Outlines>\n<Outline>1: a</Outline>\n"
            "<Outline>2: b</Outline>\n</Outlines>")
# Two closing threads, for the outlines above.
CLOSING = {"1": " 2*3=6\n</Thread>", "2": " 6*4=24\n</Thread>"}


def threadweaver_case(name: str,
                      root: str,
                      threads: Optional[dict[str, str]] = None,
                      window: int = 120,
                      settings: Optional[dict] = None) -> dict[str, Any]:
    """One answer of `ThreadWeaverController` (with ``settings``) on a
    `ScriptedThreads`, in a context window of ``window``, and its
    calls."""
    prompt = TW_TOKENIZER.encode(TW_PROMPT)
    model = ScriptedThreads(len(prompt), root, threads or {})
    backend = Recorded(
        ScriptedBackend(model.next_token, TW_TOKENIZER.eos_token_id, window))
    controller = ThreadWeaverController(TW_TOKENIZER, **(settings or {}))
    [[out]] = run(controller, backend, [prompt])
    calls = [
        dict(prompt=TW_TOKENIZER.decode(ids),
             prompt_ids=ids,
             params=params,
             token_ids=done.token_ids,
             text=TW_TOKENIZER.decode(done.token_ids),
             finish_reason=done.finish_reason)
        for ids, params, done in backend.calls
    ]
    return dict(name=name,
                prompt=TW_PROMPT,
                prompt_ids=prompt,
                window=window,
                settings=settings or {},
                model=dict(root=root, threads=threads or {}),
                calls=calls,
                token_ids=out.token_ids,
                text=out.text,
                ended=out.ended,
                forks=[[b.label for b in fork.branches] for fork in out.forks])


def threadweaver_cases() -> list[dict[str, Any]]:
    """ThreadWeaver's golden cases."""
    rounds = "".join(
        OUTLINES.replace("<Parallel>\n", "") + f"\nr{i} " for i in range(3))
    short = {"1": " t1</Thread>", "2": " t2</Thread>"}
    # Three rounds of outlines, each cut by one limit.
    limits = [("the step limit after a join", dict(max_iterations=4)),
              ("the step limit at outlines", dict(max_iterations=5)),
              ("the response budget", dict(response_length=95))]
    return [
        threadweaver_case("several outlines",
                          OUTLINES + "\n</Parallel>\nA: 24<eos>", CLOSING),
        threadweaver_case(
            "a repeated label", "<Outlines>\n<Outline>1: a</Outline>\n"
            "<Outline>1: again</Outline>\n<Outline>3: c</Outline>\n"
            "</Outlines>\nok<eos>", {
                "1": " one</Thread>",
                "3": " three</Thread>"
            }),
        threadweaver_case(
            "decimal labels", "<Parallel>\n<Outlines>\n<Outline>1.1: a"
            "</Outline>\n<Outline> 1.2 : b</Outline>\n</Outlines>\n"
            "</Parallel>\ndone<eos>", {
                "1.1": " x</Thread>",
                "1.2": " y</Thread>"
            }),
        threadweaver_case("a thread that hits EOS", OUTLINES + "\nnever", {
            "1": " done<eos>",
            "2": " fine</Thread>"
        }),
        threadweaver_case("a thread that hits the window",
                          OUTLINES + "\nnever", {
                              "1": " short</Thread>",
                              "2": " " + "x" * 200
                          }),
        threadweaver_case("no outline", "just an answer<eos>"),
        threadweaver_case(
            "an outline with no label",
            "<Outlines>\n<Outline>a: no number</Outline>\n</Outlines>"
            " then on<eos>"),
        threadweaver_case(
            "two rounds", OUTLINES + "\nmid " +
            OUTLINES.replace("<Parallel>\n", "") + "\nend<eos>", short),
        *(threadweaver_case(
            name, rounds + "end<eos>", short, window=400, settings=settings)
          for name, settings in limits),
        threadweaver_case("the conclusion variant",
                          OUTLINES + "\n<Conclusion>\nA: 24\n</Conclusion>"
                          "\n</Parallel><eos>",
                          CLOSING,
                          settings={"no_conclusion": False}),
    ]


def golden(name: str) -> dict[str, Any]:
    """The golden file ``name`` ("apr" or "threadweaver"), as data."""
    if name == "apr":
        tokenizer, cases, writer = APR_TOKENIZER, apr_cases(), "APRController"
    else:
        tokenizer, cases = TW_TOKENIZER, threadweaver_cases()
        writer = "ThreadWeaverController"
    return {
        "format": name,
        "written_by": f"sequence_hooks_references.formats.golden ({writer} "
        "over a scripted greedy model)",
        "tokenizer": tokenizer.to_json(),
        "cases": cases,
    }


def dumps(value: Any, indent: str = "") -> str:
    """JSON with every object's fields on lines of their own and every
    list of plain values on one line."""
    inner = indent + " "
    if isinstance(value, dict) and value:
        fields = [
            f"{inner}{json.dumps(k)}: {dumps(v, inner)}"
            for k, v in value.items()
        ]
        return "{\n" + ",\n".join(fields) + "\n" + indent + "}"
    if isinstance(value, list) and any(
            isinstance(v, (dict, list)) for v in value):
        items = [inner + dumps(v, inner) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + indent + "]"
    return json.dumps(value)


FILES = ("apr", "threadweaver")


def write(folder: Path = GOLDEN) -> list[Path]:
    """Writes every golden file into ``folder``; their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name in FILES:
        path = folder / f"{name}.json"
        path.write_text(dumps(golden(name)) + "\n")
        written.append(path)
    return written


class Replay:
    """A model that writes golden calls' completions, and counts what it
    is asked.

    After a context that is a golden call's prompt (the longest, if
    several) followed by part of its completion, it gives the
    completion's next token; after any other context, EOS, and it keeps
    the context as a call no golden call makes.

    Args:
        calls: Each golden call's prompt ids and sampled ids.
        eos: The EOS id.
    """

    def __init__(self, calls: list[tuple[list[int], list[int]]], eos: int):
        self.calls = [(tuple(p), tuple(s)) for p, s in calls]
        self.eos = eos
        # Per (call, position), the times that token was asked for; a
        # call stands for every identical one.
        self.asked: Counter = Counter()
        self.unexpected: list[list[int]] = []

    @classmethod
    def of(cls, calls: list[dict[str, Any]], eos: int) -> "Replay":
        """The replay of a golden case's ``calls``."""
        return cls([(c["prompt_ids"], c["token_ids"]) for c in calls], eos)

    def next_token(self, context: list[int]) -> int:
        """The golden completion's next token, or EOS."""
        best = None
        for k, (prompt, sampled) in enumerate(self.calls):
            done = tuple(context[len(prompt):])
            if (tuple(context[:len(prompt)]) == prompt
                    and len(done) < len(sampled)
                    and sampled[:len(done)] == done and
                (best is None or len(prompt) > len(self.calls[best][0]))):
                best = k
        if best is None:
            self.unexpected.append(list(context))
            return self.eos
        prompt, sampled = self.calls[best]
        at = len(context) - len(prompt)
        self.asked[self.calls.index(self.calls[best]), at] += 1
        return sampled[at]

    def differences(self, decode: Callable[[list[int]], str]) -> list[str]:
        """How the calls made differ from the golden ones: a golden call
        whose tokens were not each asked for as often as it is listed,
        and every call no golden call makes (``decode`` shows them)."""
        found = []
        times = Counter(self.calls)
        for k, (prompt, sampled) in enumerate(self.calls):
            if self.calls.index((prompt, sampled)) != k:
                continue
            asked = [self.asked[k, at] for at in range(len(sampled))]
            if asked != [times[prompt, sampled]] * len(sampled):
                found.append(
                    f"golden call {k} (prompt ending "
                    f"{decode(list(prompt))[-60:]!r}; {len(sampled)} tokens, "
                    f"each to be asked {times[prompt, sampled]} time(s)): "
                    "(times asked, tokens) "
                    f"{sorted(Counter(asked).items())}")
        for context in self.unexpected:
            found.append("a call no golden call makes, at "
                         f"{decode(context)[-80:]!r}")
        return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", default=GOLDEN)
    for path in write(parser.parse_args().out):
        print(path)


if __name__ == "__main__":
    main()
