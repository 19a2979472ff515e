# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Multiverse's format (docs/formats.md), served in the layout its models
were trained with (`sequence_hooks.splice_join`).

A ``<Parallel>`` block's goal lists outlines (``<Outline>1: ...``); at
`</Goal>` one path forks per outline label (the regex of Multiverse's
engine), each with the header ``"<Path>\\n{label}:"``; a path ends at
`</Path>`; the join splices the paths' KV and computes
``"<Conclusion>\\n"``, after which the model writes the conclusion and
closes the block. A path may open a block of its own (nesting).
"""

import re

from sequence_hooks.splice_join import SpliceTags, splice_format

FORMAT = splice_format(
    "multiverse",
    SpliceTags("<Goal>", "</Goal>", "<Path>", "</Path>", "<Conclusion>"),
    re.compile(r"<Outline>\s*([0-9]+(?:\.[0-9]+)*)\s*:"),
    nests=True,
    summary="a block's outlines fork paths, nested or not, joined by their "
    "KV at Multiverse's trained positions")
