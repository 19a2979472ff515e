# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the format toys' tokenizers (apr_task, threadweaver_task) share:
their four special tokens, a word-level vocabulary that splits text into
its pieces and joins them back, and transformers' wrapper around it."""

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"


def word_level(pieces: list[str], split: str) -> Tokenizer:
    """A backend whose vocabulary is UNK, BOS, EOS, PAD, then ``pieces``;
    every match of the regex ``split`` is one token (UNK if it is not a
    piece), and decoding joins the tokens."""
    vocab = {t: i for i, t in enumerate([UNK, BOS, EOS, PAD] + pieces)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(split),
                                                 behavior="isolated")
    backend.decoder = decoders.Fuse()
    return backend


def wrapped(backend: Tokenizer, **options) -> PreTrainedTokenizerFast:
    """``backend`` as transformers' tokenizer, with BOS, EOS, UNK and PAD
    as its special tokens, no clean-up of spaces, and ``options``."""
    return PreTrainedTokenizerFast(tokenizer_object=backend,
                                   bos_token=BOS,
                                   eos_token=EOS,
                                   unk_token=UNK,
                                   pad_token=PAD,
                                   clean_up_tokenization_spaces=False,
                                   **options)
