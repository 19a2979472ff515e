# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`SpecialKwargs.parse`: the one reader of `special_kwargs` that both
engines' settings go through (V0's `--special-kwargs`, the V1 plugin's
`--special-kwargs`, `special_kwargs=` and `additional_config`)."""

import json

import pytest

from sequence_hooks import SpecialKwargs

FIELDS = {"sync_token": "<sync>", "promise_token_id": 7, "max_depth": 3}


@pytest.mark.parametrize(
    "given", [FIELDS, json.dumps(FIELDS),
              SpecialKwargs(**FIELDS)],
    ids=["dict", "json", "itself"])
def test_every_form_reads_as_the_same_configuration(given):
    parsed = SpecialKwargs.parse(given)
    assert parsed == SpecialKwargs(**FIELDS)
    assert (parsed.sync_token, parsed.promise_token_id,
            parsed.max_depth) == ("<sync>", 7, 3)


@pytest.mark.parametrize("given, reason", [
    ({
        **FIELDS, "max_dept": 2
    }, "max_dept"),
    ('{"sync_token": "<sync>"', "Invalid JSON"),
    ({
        "sync_token": "<sync>"
    }, "promise_token_id or promise_token is required"),
    (["<sync>", "<promise>"], "must be SpecialKwargs, a dict or its JSON"),
],
                         ids=["unknown-key", "bad-json", "no-promise", "list"])
def test_a_bad_configuration_is_refused_with_its_reason(given, reason):
    with pytest.raises(ValueError, match=reason):
        SpecialKwargs.parse(given)


class WordTokenizer:
    """A tokenizer of three words; `<sync>` and `<promise>` are ids 1, 2."""

    vocab = {"<eos>": 0, "<sync>": 1, "<promise>": 2}

    def convert_tokens_to_ids(self, token):
        return self.vocab.get(token)

    def convert_ids_to_tokens(self, token_id):
        return {i: t for t, i in self.vocab.items()}[token_id]

    def tokenize(self, text):
        return list(text)


def test_for_model_resolves_then_checks_against_the_model():
    """The one start-up check of both engines: strings to ids, ids in the
    vocabulary and none the EOS; the tokenizer is loaded only for
    strings."""
    loads = []

    def tokenizer():
        loads.append(True)
        return WordTokenizer()

    given = SpecialKwargs.parse({
        "sync_token": "<sync>",
        "promise_token": "<promise>"
    })
    resolved = given.for_model(tokenizer, 3, 0)
    assert (resolved.sync_token_id, resolved.promise_token_id) == (1, 2)
    assert resolved.is_resolved and loads == [True]
    assert resolved.for_model(tokenizer, 3, [0, None]) == resolved
    assert loads == [True]
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        resolved.for_model(tokenizer, 2, 0)
    with pytest.raises(ValueError, match="end-of-sequence"):
        resolved.for_model(tokenizer, 3, [0, 2])
    with pytest.raises(ValueError, match="not a single token"):
        SpecialKwargs.parse({
            "sync_token": "<sync>",
            "promise_token": "<nope>"
        }).for_model(tokenizer, 3, 0)
