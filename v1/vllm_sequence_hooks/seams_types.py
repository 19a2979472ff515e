# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the seams table is made of: a row (`Seam`), what one vLLM version
has of it (`Expect`, an entry of `records/<version>.json`), an upstream
method copied into the plugin (`Vendored`), and the "remove when" phrases
rows of several tables share.
"""

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Seam:
    """One upstream member the plugin overrides or reaches.

    `member` is `module:Qualified.name`, as the plugin imports it; a group
    of attributes or fields of one class is `module:Class.{a,b}`.
    """

    member: str
    # overrides, calls, reads, writes, constructs, subclasses, relies on
    # (behaviour used without a call: its source is hashed), imitates (we
    # pass a stand-in of it), wraps (replaced in memory by a wrapper that
    # passes every argument on to it) or annotates.
    kind: str
    why: str
    remove_when: str
    # For `imitates`: upstream functions that read, of their parameter
    # `request`, only the names of `member`.
    readers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Expect:
    """What one vLLM version has of a seam; each field set is checked."""

    # Parameters as `tripwires.signature_text` writes them.
    signature: Optional[str] = None
    # sha256 of its source (`inspect.getsource`), or of `repr` of a value.
    source_sha256: Optional[str] = None
    # For a class we subclass: exactly the methods it defines itself.
    defines: Optional[tuple[str, ...]] = None
    # The version has none of the seam's names: the plugin does without
    # them there (`releases`), and they must not appear unrecorded.
    absent: bool = False


@dataclass(frozen=True)
class Vendored:
    """An upstream method copied into the plugin for a release that lacks
    it (`releases.VENDORED`).

    `diff` is `difflib.ndiff` of the upstream method's code and the
    copy's (`tripwires.code`: comments and layout left out, so a comment
    rewrapped to 80 columns is no difference), empty when they are the
    same.
    """

    # The copy, `module:Qualified.name`.
    copy: str
    # The seam of the upstream method and the release copied from; the
    # sha256 of its source is that release's record's.
    upstream: str
    release: str
    source_sha256: str
    # sha256 of the upstream method's `tripwires.code`.
    code_sha256: str
    diff: tuple[str, ...] = ()


# When a reach can go, for rows of more than one table.
NEVER_GIVEN = "never: what a scheduler subclass is given"
PUBLIC_API = "never: public vLLM API"
TREE_CHANNEL = ("V1's engine-core and request outputs get a free-form field "
                "for plugins' per-request data")
SAMPLE_INFO = ("the frontend tells the engine core a sample's request and "
               "index (an `EngineCoreRequest` field)")
STOP_STRINGS = ("upstream checks stop strings in the engine core, or reports "
                "the frontend's stop to the scheduler before the request's "
                "last output")
