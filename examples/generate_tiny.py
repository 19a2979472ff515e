# SPDX-License-Identifier: Apache-2.0
"""Generates a few completions with the tiny test model on the fork.

The README's main job until the trained promise/sync model lands: it makes
the tiny model in a temporary folder, runs the patched V0 engine on the CPU
and prints what it wrote.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "mytests"))

from tiny_model import build_tiny_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt",
                        action="append",
                        help="a prompt (repeatable); words of the tiny "
                        "vocabulary, e.g. 'the cat sees'")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    prompts = args.prompt or ["the cat sees", "one two three", "big red"]

    os.environ.setdefault("VLLM_USE_V1", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm
    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as folder:
        model = build_tiny_model(Path(folder))
        llm = LLM(model=str(model),
                  max_model_len=256,
                  enforce_eager=True,
                  dtype="float32")
        outputs = llm.generate(
            prompts,
            SamplingParams(temperature=0.0,
                           max_tokens=args.max_tokens,
                           ignore_eos=True))
    print(f"\nvllm {vllm.__version__}, engine "
          f"{type(llm.llm_engine).__module__}, output processor "
          f"{type(llm.llm_engine.output_processor).__name__}")
    for output in outputs:
        print(f"{output.prompt!r} -> {output.outputs[0].text!r}")


if __name__ == "__main__":
    main()
