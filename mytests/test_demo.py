# SPDX-License-Identifier: Apache-2.0
"""The README's first command: the demo on the embedded model prints the
answer and the promise tree, and its timeline shows what the engine did
step by step."""

import importlib
import sys
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tools"))
demo = importlib.import_module("demo")
task = importlib.import_module("train_promise_model")

GROUPS = [["red", "cat", "dog", "sun", "moon"],
          ["fish", "big", "old", "new", "star"]]


def test_demo_prints_the_tree_and_draws_every_step(tmp_path, monkeypatch,
                                                   capsys):
    drawn = {}
    draw_timeline = demo.draw_timeline

    def spy(events, num_steps, path):
        drawn.update(events=events, num_steps=num_steps)
        draw_timeline(events, num_steps, path)

    picture = tmp_path / "timeline.png"
    monkeypatch.setattr(demo, "draw_timeline", spy)
    monkeypatch.setattr(sys, "argv", [
        "demo.py", "--prompt",
        task.prompt_of(GROUPS), "--timeline",
        str(picture)
    ])
    demo.main()

    printed = capsys.readouterr().out
    assert f"answer: {task.expected_parent_text(GROUPS)}" in printed
    for group in GROUPS:
        assert f"(stop): '{task.child_answer(group)}'" in printed
    assert f"timeline ({drawn['num_steps']} engine steps): {picture}" in (
        printed)

    events = drawn["events"]
    root = events.pop("0")
    children = [events[lane] for lane in sorted(events, key=demo.lane_order)]
    assert len(children) == len(GROUPS)
    kinds = [root[step] for step in sorted(root)]
    # Every step of the root is accounted for, from its prompt to its end.
    assert sorted(root) == list(range(len(root)))
    # The prompt's prefill samples the first <promise>, decodes sample the
    # others and <sync>; parked; then one resume chunk and decodes.
    promises = len(GROUPS)
    parked = 1 + promises
    assert kinds[:parked + 1] == (["prefill"] + ["run"] * promises +
                                  ["parked"])
    resume = kinds.index("prefill", parked)
    assert set(kinds[parked:resume]) == {"parked"}
    assert set(kinds[resume + 1:]) == {"run"}
    for i, child in enumerate(children):
        steps = sorted(child)
        # Spawned by the i-th promise: starts the step after it, with a
        # prefill of its <promise> and <child> marker.
        assert steps[0] == 1 + i and child[steps[0]] == "prefill"
        assert steps == list(range(steps[0], steps[-1] + 1))
        assert steps[-1] < resume
    # The parent resumes the step after its last child ends.
    assert resume == max(max(child) for child in children) + 1

    with Image.open(picture) as image:
        lanes = 1 + len(GROUPS)
        assert image.height == demo.LANE_HEIGHT * (lanes + 4)
        assert (demo.MIN_WIDTH - drawn["num_steps"] < image.width <=
                demo.MIN_WIDTH)
