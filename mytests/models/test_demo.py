# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The demo prints the answers and their promise trees, on the real model
by default and on the embedded toy, and its timeline shows what the engine
did step by step."""

import re
import subprocess
import sys
from pathlib import Path

from PIL import Image

from sequence_hooks_bench.timeline import (LANE_HEIGHT, draw_timeline,
                                           layout_timeline, run_with_timeline)
from sequence_hooks_training import expand_task as task
from vllm import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "demo.py"
GROUPS = [["red", "cat", "dog", "sun", "moon"],
          ["fish", "big", "old", "new", "star"]]


def test_demo_prints_the_answer_and_its_tree(tmp_path, expand_model_path):
    picture = tmp_path / "timeline.png"
    result = subprocess.run([
        sys.executable,
        str(DEMO), "--model",
        str(expand_model_path), "--prompt",
        task.prompt_of(GROUPS), "--timeline",
        str(picture)
    ],
                            capture_output=True,
                            text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout
    assert f"answer: {task.expected_parent_text(GROUPS)}" in printed
    assert "tree:   0 (the parent, stop)" in printed
    for group in GROUPS:
        assert f"(stop): '{task.child_text(group)}'" in printed
    assert f"engine steps): {picture}" in printed
    with Image.open(picture) as image:
        # One lane per sequence, between a top margin and the axis/legend.
        assert image.height == LANE_HEIGHT * (1 + len(GROUPS) + 4)


def test_demo_runs_the_real_model_by_default(tmp_path):
    picture = tmp_path / "timeline.png"
    result = subprocess.run(
        [sys.executable, str(DEMO), "--timeline",
         str(picture)],
        capture_output=True,
        text=True,
        timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout
    prompts = re.findall(r"^prompt: (.*)$", printed, re.MULTILINE)
    assert prompts and all("capital" in p for p in prompts)
    # Every request spawned children, which finished and were merged.
    assert printed.count("tree:   ") == len(prompts)
    children = re.findall(r"^ {10}\S+ \((?:stop|length)\): '.+'$", printed,
                          re.MULTILINE)
    assert len(children) >= len(prompts)
    with Image.open(picture) as image:
        assert image.height == LANE_HEIGHT * (len(prompts) + len(children) + 4)


def test_timeline_shows_every_step_of_the_fan_out(expand_llm, tmp_path):
    [output], events, num_steps = run_with_timeline(
        expand_llm, [task.prompt_of(GROUPS)],
        SamplingParams(temperature=0.0, max_tokens=128))
    assert output.outputs[0].text.split() == task.expected_parent_text(
        GROUPS).split()
    layout = layout_timeline(events, num_steps)
    children = [child.request_id for child in output.promise_tree.children]
    # The parent's lane, then one per child in spawn order.
    assert layout.lanes == ["0"] + children
    root = layout.cells["0"]
    kinds = [root[step] for step in sorted(root)]
    # Every step of the root is accounted for, from its prompt to its end.
    assert sorted(root) == list(range(num_steps))
    # The prompt's prefill samples the first <promise>, decodes sample the
    # others and <sync>; parked; then one resume chunk and decodes.
    promises = len(GROUPS)
    parked = 1 + promises
    assert kinds[:parked + 1] == (["prefill"] + ["run"] * promises +
                                  ["parked"])
    resume = kinds.index("resume")
    assert set(kinds[parked:resume]) == {"parked"}
    assert set(kinds[resume + 1:]) == {"run"}
    for i, child in enumerate(children):
        steps = sorted(layout.cells[child])
        # Spawned by the i-th promise: starts the step after it, with a
        # prefill of its <promise> and <child> marker, then decodes.
        assert steps[0] == 1 + i and layout.cells[child][steps[0]] == "prefill"
        assert steps == list(range(steps[0], steps[-1] + 1))
        assert {layout.cells[child][step] for step in steps[1:]} == {"run"}
        assert steps[-1] < resume
    # The parent resumes the step after its last child ends.
    assert resume == max(max(layout.cells[c]) for c in children) + 1
    # A spawn mark where each child starts, a merge mark where the parent
    # resumes, and nothing else.
    assert sorted(
        layout.marks) == sorted([(child, 1 + i, "spawn")
                                 for i, child in enumerate(children)] +
                                [("0", resume, "merge")])
    picture = tmp_path / "timeline.png"
    draw_timeline(layout, picture)
    with Image.open(picture) as image:
        assert image.height == LANE_HEIGHT * (len(layout.lanes) + 4)
