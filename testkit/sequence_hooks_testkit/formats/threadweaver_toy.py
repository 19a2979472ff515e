# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""models/threadweaver-toy as the model-free tests of ThreadWeaver's format
on the V1 scheduler read it: its folder (configuration and tokenizer; no
weights are read), tokenizer, the ids they script with and a prompt of
its task."""

from pathlib import Path

from transformers import AutoTokenizer

MODEL = Path(__file__).resolve().parents[3] / "models" / "threadweaver-toy"
TOKENIZER = AutoTokenizer.from_pretrained(MODEL)
EOS = TOKENIZER.eos_token_id
OPEN_THREAD, CLOSE_THREAD = TOKENIZER.convert_tokens_to_ids(
    ["<Thread>", "</Thread>"])
PROMPT = TOKENIZER.encode("1: 24 ; 2: 784 854\n", add_special_tokens=False)
