# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine's lifecycle against the formats' golden traces
(common/tests/golden/), written by the formats' reference controllers
(`sequence_hooks_references.formats.golden`), which share no parsing,
prompt or join code with the engine.

A golden case lists every call its controller made on a scripted model
(each prompt's ids and the ids the call sampled) and the answer. Here the
engine runs the case's prompt on a model that replays those calls
(`golden.Replay`): it goes on only from a context that is a golden
call's prompt and part of its completion, and writes EOS anywhere else.
So the engine must ask for every token of every golden call as often as
the call is listed, and for nothing else, and give the golden answer:
the same prompts, token for token, from the format's parsing, the
children's prompts it builds and its joins. The engines are the format
tests' own (`test_apr.SearchEngine`, `test_threadweaver.ThreadEngine`).

After a deliberate change of a controller or a case, rewrite the files
with ``python -m sequence_hooks_references.formats.golden`` and review the
difference.
"""

import ast
import dataclasses
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import test_apr
import test_threadweaver

from sequence_hooks_references.formats import golden

GOLDEN = Path(__file__).parent / "golden"
APR = json.loads((GOLDEN / "apr.json").read_text())
THREADWEAVER = json.loads((GOLDEN / "threadweaver.json").read_text())
# APR's engine's context window: room for every golden call.
APR_WINDOW = 2048


def apr_differences(case: dict[str, Any]) -> list[str]:
    """How the engine's search of a golden APR case differs from it: its
    calls (`golden.Replay.differences`), its output (the final trace after
    the prompt, then the EOS that ended it) and its sub-searches' final
    traces."""
    replay = golden.Replay.of(case["calls"], test_apr.EOS)
    engine = test_apr.SearchEngine(replay, APR_WINDOW, case["max_tokens"])
    report = engine.run(case["root"])
    found = replay.differences(test_apr.TOKENIZER.decode)
    output = list(report.output_token_ids)
    if output != [
            *test_apr.TOKENIZER.encode(case["trace"][len(case["root"]):]),
            test_apr.EOS
    ]:
        found.append("the output differs: "
                     f"{test_apr.TOKENIZER.decode(output)!r}")
    children = [child.text for child in report.tree.children]
    if children != [trace for round_ in case["rounds"] for trace in round_]:
        found.append(f"the sub-searches' traces differ: {children!r}")
    return found


def threadweaver_differences(case: dict[str, Any],
                             seed: Optional[int]) -> list[str]:
    """How the engine's answer to a golden ThreadWeaver case, its root
    seeded ``seed``, differs from it: its calls and its output."""
    replay = golden.Replay.of(case["calls"], test_threadweaver.EOS)
    settings = case["settings"]
    engine = test_threadweaver.ThreadEngine(replay, case["window"],
                                            settings.get("response_length"),
                                            {}, seed)
    policy = engine.coordinator.policy
    policy.format = dataclasses.replace(
        policy.format,
        max_steps=settings.get("max_iterations", policy.format.max_steps),
        no_conclusion=settings.get("no_conclusion", True))
    output = engine.run(case["prompt_ids"])
    found = replay.differences(test_threadweaver.TOKENIZER.decode)
    if output != case["token_ids"]:
        found.append("the output differs: "
                     f"{test_threadweaver.TOKENIZER.decode(output)!r}")
    return found


def named(cases: list[dict[str, Any]]) -> list:
    return [pytest.param(case, id=case["name"]) for case in cases]


def imported_names(path: Path) -> list[str]:
    """What ``path``'s code imports, anywhere in it: each module, and for
    ``from M import N`` also ``M.N`` (a module or a name in M)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names += [module, *(f"{module}.{a.name}" for a in node.names)]
    return names


def module_file(name: str) -> Optional[Path]:
    """The file of module ``name``, None if ``name`` is no module."""
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None
    return Path(spec.origin) if spec and spec.origin else None


def test_the_controllers_import_nothing_of_the_engine():
    """The controllers (the references' formats package) and the test
    kit's modules they use (ThreadWeaver's text, the scripted searches)
    share no code with the engine's formats: a slip there would agree with
    itself."""
    paths = set(Path(golden.__file__).parent.glob("*.py"))
    kit = {
        name
        for path in paths
        for name in imported_names(path)
        if name.startswith("sequence_hooks_testkit.")
    }
    paths |= {module_file(name) for name in kit} - {None}
    assert any("sequence_hooks_testkit" in str(p) for p in paths), paths
    for path in sorted(paths):
        names = imported_names(path)
        assert not [
            n for n in names
            if n == "sequence_hooks" or n.startswith("sequence_hooks.")
        ], (path.name, names)


@pytest.mark.parametrize("name", golden.FILES)
def test_the_golden_files_are_what_the_controllers_write(name):
    path = GOLDEN / f"{name}.json"
    assert path.read_text() == golden.dumps(golden.golden(name)) + "\n"


def test_the_golden_tokenizers_are_the_engines():
    """Each file's prompts are the ids the engine's tokenizer gives."""
    for data, tokenizer in ((APR, test_apr.TOKENIZER),
                            (THREADWEAVER, test_threadweaver.TOKENIZER)):
        assert data["tokenizer"]["eos_token_id"] == tokenizer.eos_token_id
        for case in data["cases"]:
            for call in case["calls"]:
                assert tokenizer.encode(call["prompt"]) == call["prompt_ids"]


@pytest.mark.parametrize("case", named(APR["cases"]))
def test_the_engine_makes_the_golden_apr_calls(case):
    assert apr_differences(case) == []


@pytest.mark.parametrize("seed", [None, 7], ids=["unseeded", "seeded"])
@pytest.mark.parametrize("case", named(THREADWEAVER["cases"]))
def test_the_engine_makes_the_golden_threadweaver_calls(case, seed):
    """Unseeded, the root resumes after a join; seeded, each of its calls
    after the first is a new one (`Restart`): the same calls."""
    assert threadweaver_differences(case, seed) == []


def apr_module():
    """The module of the engine's APR format (its grammar and join)."""
    engine = test_apr.SearchEngine(None, APR_WINDOW, 1)
    return sys.modules[type(engine.coordinator.policy.format).__module__]


def threadweaver_module():
    """The module of the engine's ThreadWeaver format."""
    engine = test_threadweaver.ThreadEngine(None, 1, None, {})
    return sys.modules[type(engine.coordinator.policy.format).__module__]


def swap_target_and_numbers(monkeypatch) -> None:
    """A child's prompt with its state's numbers before its target."""
    node = apr_module().Node
    prefix = node.prefix
    monkeypatch.setattr(
        node, "prefix", lambda self, budget: re.sub(
            r"Current State: (\d+):(\[[^\]]*\])", r"Current State: \2:\1",
            prefix(self, budget)))


def misspell_the_call_tag(monkeypatch) -> None:
    """The call's tag, which the join cuts at, one character off."""
    monkeypatch.setattr(apr_module(), "CALL", "<Calling Sub-Searches>\n")


def misspell_the_closure(monkeypatch) -> None:
    """An unclosed thread closed with `<Thread>` for `</Thread>`."""
    monkeypatch.setattr(threadweaver_module(), "CLOSURE", "\n<Thread>")


def misread_the_labels(monkeypatch) -> None:
    """The outline labels read before a ";" for a ":"."""
    monkeypatch.setattr(threadweaver_module(), "LABEL_PATTERN",
                        re.compile(r"<Outline>\s*([0-9]+(?:\.[0-9]+)*)\s*;"))


def apr_case_differs(name: str) -> bool:
    [case] = [c for c in APR["cases"] if c["name"] == name]
    return bool(apr_differences(case))


def threadweaver_case_differs(name: str) -> bool:
    [case] = [c for c in THREADWEAVER["cases"] if c["name"] == name]
    return bool(threadweaver_differences(case, None))


@pytest.mark.parametrize("mutate,differs,case", [
    (swap_target_and_numbers, apr_case_differs, "one round"),
    (misspell_the_call_tag, apr_case_differs, "one round"),
    (misspell_the_closure, threadweaver_case_differs,
     "a thread that hits EOS"),
    (misread_the_labels, threadweaver_case_differs, "several outlines"),
])
def test_a_slip_in_the_engine_s_format_shows_against_the_golden(
        monkeypatch, mutate, differs, case):
    """The check can fail: one character or one field order off in the
    engine's format code, and the golden case that exercises it
    differs."""
    assert not differs(case)
    mutate(monkeypatch)
    assert differs(case)
