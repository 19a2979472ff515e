# SPDX-License-Identifier: Apache-2.0
"""Runs sequence hooks end to end with the tiny test model.

The README's main job until the trained promise/sync model lands. The tiny
model has random weights and never chooses `<promise>` or `<sync>` itself,
so a scripted logits processor makes each request promise children and
sync on them; everything else (spawning, parking, merging, resuming) is
the fork's engine at work. Prints each answer and its promise tree.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

# The tiny model kit and the scripted logits processor live with the tests.
MYTESTS = Path(__file__).resolve().parent.parent / "mytests"


def print_tree(node, indent: str = "  ") -> None:
    for child in node.children:
        print(f"{indent}child {child.request_id} ({child.finish_reason}): "
              f"{child.text.strip()!r}")
        print_tree(child, indent + "  ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt",
                        action="append",
                        help="a prompt (repeatable); words of the tiny "
                        "vocabulary, e.g. 'the cat sees'")
    parser.add_argument("--children",
                        type=int,
                        default=2,
                        help="children each request promises")
    parser.add_argument("--child-tokens",
                        type=int,
                        default=6,
                        help="tokens each child writes")
    args = parser.parse_args()
    prompts = args.prompt or ["the cat sees", "one two three", "big red"]

    sys.path.insert(0, str(MYTESTS))
    from scripted_hooks import ScriptedHooks
    from tiny_model import (CHILD, PROMISE, SPECIAL_TOKENS, SYNC,
                            build_tiny_model, build_tokenizer)

    os.environ.setdefault("VLLM_USE_V1", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.config import SpecialKwargs

    tokenizer = build_tokenizer()
    sync, promise, child, eos = tokenizer.convert_tokens_to_ids(
        [SYNC, PROMISE, CHILD, tokenizer.eos_token])
    # The parent writes a word, promises the children, syncs, writes three
    # more words; each child writes its words and ends.
    plans = {(): [None] + [promise] * args.children + [sync, None, None, None]}
    for k in range(args.children):
        plans[(k, )] = [None] * args.child_tokens
    hooks = ScriptedHooks(plans, promise, child, eos,
                          range(len(SPECIAL_TOKENS)))

    with tempfile.TemporaryDirectory() as folder:
        model = build_tiny_model(Path(folder))
        llm = LLM(model=str(model),
                  max_model_len=256,
                  enforce_eager=True,
                  dtype="float32",
                  special_kwargs=SpecialKwargs(sync_token_id=sync,
                                               promise_token_id=promise,
                                               child_role_token_id=child))
        outputs = llm.generate(
            prompts,
            SamplingParams(temperature=0.0,
                           max_tokens=64,
                           logits_processors=[hooks]))
    print(f"\nvllm {vllm.__version__}, output processor "
          f"{type(llm.llm_engine.output_processor).__name__}")
    for output in outputs:
        print(f"\n{output.prompt!r} -> {output.outputs[0].text.strip()!r}")
        print_tree(output.promise_tree)


if __name__ == "__main__":
    main()
