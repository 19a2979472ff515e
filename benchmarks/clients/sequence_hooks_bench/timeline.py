# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A promise tree's run over engine steps: recorded, laid out and drawn.

One lane per sequence (requests in order, each followed by its children in
spawn order), one cell per engine step it was live in, coloured by what it
did; marks where a child was spawned and where a parent resumed with the
merge. The demo draws it; tests check its layout.
"""

from dataclasses import dataclass, field
from pathlib import Path

from sequence_hooks_testkit.schedule_recorder import ScheduleRecorder

LANE_HEIGHT, STEP_WIDTH, MARGIN, MIN_WIDTH = 22, 12, 130, 960
# Cell colour per kind of step.
COLORS = {
    "run": (70, 130, 180),
    "prefill": (230, 150, 30),
    "resume": (230, 150, 30),
    "parked": (200, 200, 200),
}
# Mark colour per event.
MARK_COLORS = {"spawn": (255, 0, 0), "merge": (0, 128, 0)}
LEGEND = ("blue: decode  orange: prefill chunk (prompt, child start, "
          "resume)  grey: parked by <sync>  red: spawn  green: merged, "
          "resuming")

# Per request id (children included), the kind of each step it was live in.
Events = dict[str, dict[int, str]]


def run_with_timeline(llm, prompts, params):
    """Generates for ``prompts``, stepping the engine by hand to note what
    each sequence did at each step.

    Args:
        llm: A hooked `LLM`.
        prompts: The prompts; their requests get ids "0", "1", ...
        params: The sampling parameters of every prompt.

    Returns:
        The outputs in prompt order; the events (kinds: "prefill": a prompt
        or a child's start, "run": a decode, "parked", "resume": the prefill
        of merged tokens); and the number of steps.
    """
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    events: Events = {}
    outputs = {}
    with ScheduleRecorder(engine.scheduler[0]) as recorder:
        while engine.has_unfinished_requests():
            finished = engine.step()
            record_step(events, recorder.steps[-1], len(recorder.steps) - 1)
            outputs.update((o.request_id, o) for o in finished if o.finished)
    return ([outputs[str(i)]
             for i in range(len(prompts))], events, len(recorder.steps))


def record_step(events: Events, step, index: int) -> None:
    """Adds what one recorded step did to ``events``."""
    for request_id in step.parked:
        events.setdefault(request_id, {})[index] = "parked"
    for chunk in step.chunks:
        past = events.get(chunk.request_id, {})
        previous = past[max(past)] if past else None
        if not chunk.is_prompt:
            kind = "run"
        elif previous in ("prefill", "resume"):
            kind = previous  # its next chunk
        elif previous is not None and chunk.num_computed_before > 0:
            kind = "resume"
        else:  # a prompt, a child's start, or a recompute
            kind = "prefill"
        events.setdefault(chunk.request_id, {})[index] = kind


def lane_order(request_id: str) -> tuple[int, int]:
    """Sort key of a timeline lane: requests in order, each followed by its
    children in spawn order.

    Args:
        request_id: "3" for a request, "3/promise-17" for a child of it.
    """
    root, _, child = request_id.partition("/promise-")
    return int(root), int(child or -1)


@dataclass
class TimelineLayout:
    """What the timeline picture shows, before it is drawn."""
    # Lane labels (request ids), top to bottom.
    lanes: list[str]
    # Engine steps on the x axis.
    num_steps: int
    # Per lane, the kind of each step it was live in.
    cells: dict[str, dict[int, str]]
    # (lane, step, event): "spawn" at a child's first step, "merge" where a
    # parent resumes with merged tokens.
    marks: list[tuple[str, int, str]] = field(default_factory=list)


def layout_timeline(events: Events, num_steps: int) -> TimelineLayout:
    """Lays out the lanes, cells and marks of ``events``."""
    lanes = sorted(events, key=lane_order)
    layout = TimelineLayout(lanes, num_steps,
                            {lane: events[lane]
                             for lane in lanes})
    for lane in lanes:
        steps = events[lane]
        if "/" in lane:
            layout.marks.append((lane, min(steps), "spawn"))
        for step, kind in sorted(steps.items()):
            if kind == "resume" and steps.get(step - 1) != "resume":
                layout.marks.append((lane, step, "merge"))
    return layout


def draw_timeline(layout: TimelineLayout, path: Path) -> None:
    """Draws ``layout`` to a PNG at ``path``."""
    from PIL import Image, ImageDraw

    # Short runs get wider steps, so the picture is never mostly margin.
    step_width = max(STEP_WIDTH, (MIN_WIDTH - MARGIN - 20) // layout.num_steps)
    width = MARGIN + step_width * layout.num_steps + 20
    axis_y = LANE_HEIGHT * (len(layout.lanes) + 1)
    image = Image.new("RGB", (width, axis_y + 3 * LANE_HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    rows = {lane: LANE_HEIGHT * (i + 1) for i, lane in enumerate(layout.lanes)}
    for lane, y in rows.items():
        draw.text((4, y + 4), "  " * lane.count("/") + lane, fill="black")
        for step, kind in layout.cells[lane].items():
            x = MARGIN + step_width * step
            draw.rectangle([x, y + 4, x + step_width - 1, y + LANE_HEIGHT - 4],
                           fill=COLORS[kind])
    for lane, step, event in layout.marks:
        x, y = MARGIN + step_width * step, rows[lane]
        draw.line([x, y, x, y + LANE_HEIGHT], fill=MARK_COLORS[event], width=2)
    for step in range(0, layout.num_steps + 1, 5):
        x = MARGIN + step_width * step
        draw.line([x, axis_y, x, axis_y + 4], fill="black")
        draw.text((x - 3, axis_y + 6), str(step), fill="black")
    draw.text((4, axis_y + 6), "engine step", fill="black")
    draw.text((4, axis_y + LANE_HEIGHT + 10), LEGEND, fill="black")
    image.save(path)
