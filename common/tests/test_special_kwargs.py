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
