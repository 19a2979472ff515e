# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NPR's format (Native Parallel Reasoner, docs/formats.md), served in the
layout its models were trained with (`sequence_hooks.splice_join`).

A guideline lists plans (``<plan>1: ...</plan>``); at `</guideline>` one
step forks per plan label (the regex of NPR's engine), each with the
header ``"<step>\\n{label}:"``; a step ends at `</step>`; the join splices
the steps' KV and computes ``"<takeaway>\\n"``. Steps do not fork again
(NPR trains no nested block).
"""

import re

from sequence_hooks.formats import Format, FormatSetting
from sequence_hooks.lifecycle import Coordinator
from sequence_hooks.splice_join import NEEDS, SpliceFormat, SplicePolicy

NAME = "npr"
LABEL_PATTERN = re.compile(r"<plan>\s*([0-9]+(?:\.[0-9]+)*)\s*:")
# The tags the format reads, by role; each must be one token.
TAGS = {
    "goal_open": "<guideline>",
    "trigger": "</guideline>",
    "path_open": "<step>",
    "path_close": "</step>",
    "after_open": "<takeaway>",
}


def _policy(coordinator: Coordinator, setting: FormatSetting) -> SplicePolicy:
    return SplicePolicy(
        coordinator,
        SpliceFormat.for_tokenizer(NAME,
                                   setting.tokenizer,
                                   dict(setting.tags),
                                   LABEL_PATTERN,
                                   nests=False))


FORMAT = Format(name=NAME,
                policy=_policy,
                needs=NEEDS,
                tags=TAGS,
                summary="a guideline's plans fork steps, joined by their "
                "KV at NPR's trained positions")
