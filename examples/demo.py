# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
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

from sequence_hooks_testkit.timeline import (draw_timeline, layout_timeline,
                                             run_with_timeline)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "models" / "expand"
DEFAULT_PROMPTS = [
    "cat dog sun red big then old new fish tree moon",
    "tree moon up down yes then no left right blue green then star bird cat "
    "dog sun",
    "red red cat dog fish then sun moon star old new then big small up down "
    "left then right yes no tree bird",
]


def print_tree(node, indent: str) -> None:
    """Prints each child of ``node`` with what it wrote, depth first.

    Args:
        node: A `sequence_hooks.PromiseNode`.
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
    draw_timeline(layout_timeline(events, steps), Path(args.timeline))
    print(f"\ntimeline ({steps} engine steps): {args.timeline}")


if __name__ == "__main__":
    main()
