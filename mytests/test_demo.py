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
    assert "tree:   0 (the parent, stop)" in printed
    for group in GROUPS:
        assert f"(stop): '{task.child_text(group)}'" in printed
    assert f"timeline ({drawn['num_steps']} engine steps): {picture}" in (
        printed)

    events = drawn["events"]
    lanes = sorted(events, key=demo.lane_order)
    root = events["0"]
    children = [events[lane] for lane in lanes[1:]]
    assert lanes[0] == "0" and len(children) == len(GROUPS)
    kinds = [root[step] for step in sorted(root)]
    # Every step of the root is accounted for, from its prompt to its end.
    assert sorted(root) == list(range(len(root)))
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
        steps = sorted(child)
        # Spawned by the i-th promise: starts the step after it, with a
        # prefill of its <promise> and <child> marker, then decodes.
        assert steps[0] == 1 + i and child[steps[0]] == "prefill"
        assert steps == list(range(steps[0], steps[-1] + 1))
        assert {child[step] for step in steps[1:]} == {"run"}
        assert steps[-1] < resume
    # The parent resumes the step after its last child ends.
    assert resume == max(max(child) for child in children) + 1

    with Image.open(picture) as image:
        image = image.convert("RGB")
    num_steps = drawn["num_steps"]
    step_width = (image.width - demo.MARGIN - 20) // num_steps
    assert image.height == demo.LANE_HEIGHT * (len(lanes) + 4)
    assert image.width <= demo.MIN_WIDTH < image.width + num_steps

    def column(step: int) -> int:
        return demo.MARGIN + step_width * step

    for row, lane in enumerate(lanes):
        y = demo.LANE_HEIGHT * (row + 1)
        # Each live step's cell has its kind's colour; other steps are blank.
        for step in range(num_steps):
            cell = image.getpixel(
                (column(step) + step_width // 2, y + demo.LANE_HEIGHT // 2))
            kind = events[lane].get(step)
            assert cell == (demo.COLORS[kind] if kind else (255, 255, 255))

        # Marks stand out above the bars: red where a child was spawned,
        # green where the parent resumed with the merge.
        mark_step, color = ((resume, (0, 128, 0)) if lane == "0" else
                            (min(events[lane]), (255, 0, 0)))
        assert color in {
            image.getpixel((x, y + 1))
            for x in range(column(mark_step) - 1,
                           column(mark_step) + 2)
        }
