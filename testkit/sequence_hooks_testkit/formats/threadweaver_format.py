# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ThreadWeaver's format as text: the outline labels a controller forks
on, the threads' headers and closure, and what a join appends after the
threads (facebookresearch/threadweaver's `ParallelBranchingController`,
docs/formats.md).

Both sides of the format read it from here: the reference controller
(`sequence_hooks_references.formats.threadweaver_controller`), which forks
and joins with it, and models/threadweaver-toy's task
(`sequence_hooks_training.threadweaver_task`), whose training texts are
what that controller's joins write.
"""

import re

OUTLINE_PATTERN = re.compile(r"<Outline>\s*([0-9]+(?:\.[0-9]+)*)\s*:")
OUTLINES, OUTLINES_END, THREAD_END = "<Outlines>", "</Outlines>", "</Thread>"
CLOSURE = "\n</Thread>"
# After a join: go on (CONTINUATION) or close the block and stop (FINAL);
# with no_conclusion=False each opens an empty <Conclusion> instead.
CONTINUATION, FINAL = "\n", "\n</Parallel>"
CONCLUSION_CONTINUATION = "\n<Conclusion>\n"
CONCLUSION_FINAL = "\n<Conclusion>\n</Conclusion>\n</Parallel>"


def first_header(label: str) -> str:
    """A branch's prompt header, and the first branch's in the join."""
    return "\n<Thread>\n" + f"{label}:"


def later_header(label: str) -> str:
    """The join's header of every branch after the first."""
    return "<Thread>\n" + f"{label}:"


def outline_labels(text: str) -> list[str]:
    """The regex's labels after the last ``<Outlines>`` of ``text``, in
    order, repeats kept (none without ``<Outlines>``)."""
    start = text.rfind(OUTLINES)
    return [] if start < 0 else OUTLINE_PATTERN.findall(text[start:])
