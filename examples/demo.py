# SPDX-License-Identifier: Apache-2.0
"""Promise/sync demo on the embedded model that speaks the protocol.

Generates for a few prompts through `LLM(..., special_kwargs=...)` on the
fork's V0 engine, prints each answer and its promise tree, and draws a
timeline (one lane per sequence, engine steps on the x axis; spawns,
parking, merges and resumes marked) to a PNG whose path it prints.

The embedded model (models/expand, see its MODEL_CARD.md) solves the
"expand" task: for k groups of words it promises k children, each of which
writes its group's words four times and answers with the group's first
word; it syncs, and concludes with the answers it reads in the merge.
"""

import argparse
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "models" / "expand"
DEFAULT_PROMPTS = [
    "cat dog sun red big then old new fish tree moon",
    "tree moon up down yes then no left right blue green then star bird cat "
    "dog sun",
    "red red cat dog fish then sun moon star old new then big small up down "
    "left then right yes no tree bird",
]
LANE_HEIGHT, STEP_WIDTH, MARGIN, MIN_WIDTH = 22, 12, 130, 960
COLORS = {
    "run": (70, 130, 180),
    "prefill": (230, 150, 30),
    "resume": (230, 150, 30),
    "parked": (200, 200, 200),
}


def run_with_timeline(llm, prompts, params):
    """Generates for ``prompts``, stepping the engine by hand to note what
    each sequence did at each step.

    Args:
        llm: A hooked `LLM`.
        prompts: The prompts; their requests get ids "0", "1", ...
        params: The sampling parameters of every prompt.

    Returns:
        The outputs in prompt order; per request id (children included),
        the kind of each step it was live in ("prefill": its prompt or a
        child's start, "run": a decode, "parked", "resume": the prefill of
        merged tokens); and the number of steps.
    """
    engine = llm.llm_engine
    scheduler = engine.scheduler[0]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    events: dict[str, dict[int, str]] = {}
    outputs = {}
    scheduled: dict[str, str] = {}
    schedule = scheduler.schedule

    def recording_schedule():
        metadata, out, allow_async = schedule()
        # Parked for this whole step, even if its output processing merges.
        scheduled.clear()
        scheduled.update(
            (request_id, "parked") for request_id in scheduler.blocked)
        for m, g in zip(metadata, out.scheduled_seq_groups):
            past = events.get(m.request_id, {})
            previous = past[max(past)] if past else None
            computed = g.seq_group.first_seq.data.get_num_computed_tokens()
            if not m.is_prompt:
                kind = "run"
            elif previous in ("prefill", "resume"):
                kind = previous  # its next chunk
            elif previous is not None and computed > 0:
                kind = "resume"
            else:  # a prompt, a child's start, or a recompute
                kind = "prefill"
            scheduled[m.request_id] = kind
        return metadata, out, allow_async

    scheduler.schedule = recording_schedule
    step = 0
    try:
        while engine.has_unfinished_requests():
            finished = engine.step()
            for request_id, kind in scheduled.items():
                events.setdefault(request_id, {})[step] = kind
            outputs.update((o.request_id, o) for o in finished if o.finished)
            step += 1
    finally:
        scheduler.schedule = schedule
    return [outputs[str(i)] for i in range(len(prompts))], events, step


def lane_order(request_id: str) -> tuple[int, int]:
    """Sort key of a timeline lane: requests in order, each followed by its
    children in spawn order.

    Args:
        request_id: "3" for a request, "3/promise-17" for a child of it.
    """
    root, _, child = request_id.partition("/promise-")
    return int(root), int(child or -1)


def draw_timeline(events, num_steps, path: Path) -> None:
    """Draws one lane per sequence over engine steps to a PNG at ``path``.

    Args:
        events: Per request id, what it did at each step it was live (see
            `run_with_timeline`).
        num_steps: Engine steps the run took.
        path: Where to write the picture.
    """
    from PIL import Image, ImageDraw
    lanes = sorted(events, key=lane_order)
    # Short runs get wider steps, so the picture is never mostly margin.
    step_width = max(STEP_WIDTH, (MIN_WIDTH - MARGIN - 20) // num_steps)
    width = MARGIN + step_width * num_steps + 20
    axis_y = LANE_HEIGHT * (len(lanes) + 1)
    image = Image.new("RGB", (width, axis_y + 3 * LANE_HEIGHT), "white")
    draw = ImageDraw.Draw(image)

    def mark(step: int, y: int, color: str) -> None:
        x = MARGIN + step_width * step
        draw.line([x, y, x, y + LANE_HEIGHT], fill=color, width=2)

    for row, request_id in enumerate(lanes):
        y = LANE_HEIGHT * (row + 1)
        indent = "  " * request_id.count("/")
        draw.text((4, y + 4), indent + request_id, fill="black")
        steps = events[request_id]
        for step, kind in steps.items():
            x = MARGIN + step_width * step
            draw.rectangle([x, y + 4, x + step_width - 1, y + LANE_HEIGHT - 4],
                           fill=COLORS[kind])
            if kind == "resume" and steps.get(step - 1) != "resume":
                mark(step, y, "green")
        if "/" in request_id:
            mark(min(steps), y, "red")
    for step in range(0, num_steps + 1, 5):
        x = MARGIN + step_width * step
        draw.line([x, axis_y, x, axis_y + 4], fill="black")
        draw.text((x - 3, axis_y + 6), str(step), fill="black")
    draw.text((4, axis_y + 6), "engine step", fill="black")
    draw.text((4, axis_y + LANE_HEIGHT + 10),
              "blue: decode  orange: prefill chunk (prompt, child start, "
              "resume)  grey: parked by <sync>  red: spawn  green: merged, "
              "resuming",
              fill="black")
    image.save(path)


def print_tree(node, indent: str) -> None:
    """Prints each child of ``node`` with what it wrote, depth first.

    Args:
        node: A `PromiseNode`.
        indent: Printed before each of its children's lines.
    """
    for child in node.children:
        print(f"{indent}{child.request_id} ({child.finish_reason}): "
              f"{child.text.strip()!r}")
        print_tree(child, indent + "  ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model",
                        default=str(DEFAULT_MODEL),
                        help="model folder (default: the embedded model)")
    parser.add_argument("--prompt",
                        action="append",
                        help="a prompt (repeatable)")
    parser.add_argument("--sync-token",
                        default="<sync>",
                        help="token that joins the children")
    parser.add_argument("--promise-token",
                        default="<promise>",
                        help="token that spawns a child")
    parser.add_argument("--child-role-token",
                        default="<child>",
                        help="marker a child starts with ('' for none)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, help="sampling seed")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--timeline",
        default=str(Path(tempfile.gettempdir()) / "promise_timeline.png"),
        help="where to write the timeline PNG")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_USE_V1", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import SpecialKwargs

    llm = LLM(model=args.model,
              max_model_len=256,
              enforce_eager=True,
              dtype="float32",
              special_kwargs=SpecialKwargs(
                  sync_token=args.sync_token,
                  promise_token=args.promise_token,
                  child_role_token=args.child_role_token or None))
    prompts = args.prompt or DEFAULT_PROMPTS
    outputs, events, steps = run_with_timeline(
        llm, prompts,
        SamplingParams(temperature=args.temperature,
                       top_p=args.top_p,
                       seed=args.seed,
                       max_tokens=args.max_tokens))
    for output in outputs:
        print(f"\nprompt: {output.prompt}")
        print(f"answer: {output.outputs[0].text.strip()}")
        if output.promise_tree is not None:
            print(f"tree:   {output.request_id} (the parent, "
                  f"{output.outputs[0].finish_reason})")
            print_tree(output.promise_tree, indent="          ")
    draw_timeline(events, steps, Path(args.timeline))
    print(f"\ntimeline ({steps} engine steps): {args.timeline}")


if __name__ == "__main__":
    main()
