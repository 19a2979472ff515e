# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`SpecialKwargs.parse`: the one reader of `special_kwargs` that both
engines' settings go through (V0's `--special-kwargs`, the V1 plugin's
`--special-kwargs`, `special_kwargs=` and `additional_config`), and
`checked_special_kwargs`, the start check both engines run on it."""

import json

import pytest

from sequence_hooks import SpecialKwargs, formats
from sequence_hooks.special_kwargs import ModelTokens, checked_special_kwargs

FIELDS = {"sync_token": "<sync>", "promise_token_id": 7, "max_depth": 3}
# What an engine that serves promise/sync alone carries out (V0's).
PROMISE_SYNC_ONLY = frozenset({formats.FORK, formats.PARK_RESUME})


@pytest.mark.parametrize(
    "given", [FIELDS, json.dumps(FIELDS),
              SpecialKwargs(**FIELDS)],
    ids=["dict", "json", "itself"])
def test_every_form_reads_as_the_same_configuration(given):
    parsed = SpecialKwargs.parse(given)
    assert parsed == SpecialKwargs(**FIELDS)
    assert parsed == SpecialKwargs(**FIELDS, format="promise_sync")
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
    ({
        "format": "threads"
    }, "unknown format 'threads' \\(known: promise_sync, threadweaver, apr, "
     "npr, multiverse\\)"),
    ({
        "format": "threadweaver",
        "sync_token": "<sync>"
    }, "format 'threadweaver' reads its own tags: sync_token given beside "
     "it belong to promise_sync"),
    ({
        "format": "threadweaver",
        "format_tags": {
            "thread_start": "<T>"
        }
    }, "format 'threadweaver' has no tag role\\(s\\) \\['thread_start'\\]"),
    ({
        **FIELDS, "format_tags": {
            "trigger": "<go>"
        }
    }, "format_tags belong to a format's tags; format 'promise_sync' has "
     "none"),
    ({
        "format": "apr",
        "format_options": {
            "no_conclusion": False
        }
    }, "format 'apr' takes no format_options, got \\['no_conclusion'\\]"),
    ({
        "format": "threadweaver",
        "format_options": {
            "no_conclusions": False
        }
    }, "no_conclusions"),
    ({
        "format": "threadweaver",
        "format_options": {
            "no_conclusion": "no"
        }
    }, "no_conclusion"),
    ({
        **FIELDS, "no_conclusion": True
    }, "no_conclusion"),
],
                         ids=[
                             "unknown-key", "bad-json", "no-promise", "list",
                             "unknown-format",
                             "format-mixed-with-promise-sync",
                             "unknown-tag-role", "tags-without-format",
                             "options-apr-does-not-take",
                             "unknown-threadweaver-option",
                             "threadweaver-option-of-another-type",
                             "no-conclusion-not-generic"
                         ])
def test_a_bad_configuration_is_refused_with_its_reason(given, reason):
    with pytest.raises(ValueError, match=reason):
        SpecialKwargs.parse(given)


@pytest.mark.parametrize("name, missing", [
    ("threadweaver", "arrivals, branch_stops, conclude, restart"),
    ("apr", "arrivals, fresh_children, held_output, restart"),
])
def test_a_format_an_engine_cannot_carry_out_is_refused_at_start(
        name, missing):
    # It reads as data; the start check of an engine that lacks what the
    # format needs (here V0's: forks, parks and resumes) refuses it,
    # naming each missing capability.
    assert SpecialKwargs.parse({"format": name}).format == name
    with pytest.raises(ValueError) as refusal:
        checked_special_kwargs({"format": name},
                               capabilities=PROMISE_SYNC_ONLY)
    reason = str(refusal.value)
    assert reason.startswith(f"special_kwargs: format '{name}' is not "
                             "served by this engine, which does not carry "
                             "out "), reason
    named = [
        part.split(" (")[0]
        for part in reason.split("carry out ")[1].split("; ")
    ]
    assert named == missing.split(", ")
    served = checked_special_kwargs({"format": name},
                                    capabilities=frozenset(
                                        formats.ENGINE_CAPABILITIES))
    assert served.format == name


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


@pytest.mark.parametrize("given, model, reason", [
    ({
        **FIELDS, "max_dept": 2
    }, None, "special_kwargs: 1 validation error for SpecialKwargs max_dept "
     "Unexpected keyword argument"),
    ({
        "sync_token": "<sync>",
        "promise_token": "<nope>"
    }, ModelTokens(WordTokenizer, 3, 0),
     "special_kwargs: promise_token '<nope>' is not a single token"),
    ({
        "sync_token_id": 0,
        "promise_token_id": 2
    }, ModelTokens(WordTokenizer, 3, 0),
     "special_kwargs: token id(s) [0] are the model's end-of-sequence token"),
],
                         ids=["unknown-key", "not-one-token", "eos"])
def test_checked_special_kwargs_gives_one_line_reasons(given, model, reason):
    """What every process that takes the setting raises: the reason after
    `special_kwargs: `, on one line (pydantic's span several)."""
    with pytest.raises(ValueError) as refusal:
        checked_special_kwargs(given, model, capabilities=PROMISE_SYNC_ONLY)
    assert str(refusal.value).startswith(reason), str(refusal.value)
    assert "\n" not in str(refusal.value)


def test_checked_special_kwargs_reads_and_resolves():
    assert checked_special_kwargs(
        json.dumps(FIELDS),
        capabilities=PROMISE_SYNC_ONLY) == SpecialKwargs(**FIELDS)
    resolved = checked_special_kwargs(
        {
            "sync_token": "<sync>",
            "promise_token": "<promise>"
        },
        ModelTokens(WordTokenizer, 3, 0),
        capabilities=PROMISE_SYNC_ONLY)
    assert (resolved.sync_token_id, resolved.promise_token_id,
            resolved.is_resolved) == (1, 2, True)


def test_a_formats_tags_are_its_own_unless_overridden():
    own = SpecialKwargs.parse({"format": "threadweaver"})
    assert own.tags == {
        "outlines": "<Outlines>",
        "trigger": "</Outlines>",
        "thread_end": "</Thread>"
    }
    other = SpecialKwargs.parse({
        "format": "threadweaver",
        "format_tags": {
            "trigger": "<go>"
        }
    })
    assert other.tags["trigger"] == "<go>"
    assert other.tags["outlines"] == "<Outlines>"
