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

from sequence_hooks.splice_join import SpliceTags, splice_format

FORMAT = splice_format(
    "npr",
    SpliceTags("<guideline>", "</guideline>", "<step>", "</step>",
               "<takeaway>"),
    re.compile(r"<plan>\s*([0-9]+(?:\.[0-9]+)*)\s*:"),
    nests=False,
    summary="a guideline's plans fork steps, joined by their KV at NPR's "
    "trained positions")
