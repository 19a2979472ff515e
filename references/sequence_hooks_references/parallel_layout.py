# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The attention layout NPR's and Multiverse's models are trained with, as
served here: position ids and a 4-D attention mask from a token sequence.

The rules are those of the published training code (NPR
``npr-beta/train/utils.py`` ``construct_parallel_position_ids`` and
``construct_parallel_attention_mask``; Multiverse ``train/utils.py``
``generate_multiverse_position_ids`` and
``generate_multiverse_attention_mask``; docs/formats.md), with the one
departure below. A block is NPR's ``<guideline> ... </guideline>``, its
``<step> ... </step>`` paths and its ``<takeaway>``, or Multiverse's
``<Parallel> <Goal> ... </Goal>``, its ``<Path> ... </Path>`` paths, its
``<Conclusion>`` and ``</Parallel>``.

Positions. Every token's position is the previous token's plus one,
except:

- at a block's goal close (``</guideline>``, ``</Goal>``), G := its
  position;
- each path-opening tag (``<step>``, ``<Path>``) of that block gets G + 1,
  and its path's tokens count on from there;
- L_i := position(path i's close tag ``</step>``/``</Path>``) - G;
- the block's after-tag (``<takeaway>``, ``<Conclusion>``) gets
  G + max_i L_i + 1 (G + 1 if the block has no path), and the tokens after
  it count on.

Multiverse nests: a ``<Parallel>`` block may open inside a ``<Path>``; it
follows the same rules in the coordinates already compressed, and the
outer path's span (below) contains the nested block. NPR does not nest.

Mask. Causal, except that the spans of two paths of one block do not see
each other, in both directions; everything after a block sees everything
before it. A path's span is its open tag through its close tag PLUS the
single ``"\\n"`` token that follows the close tag, if one does. That
newline is the one departure from the published mask, where it is in no
span, so that every later path of the block sees it: impossible when the
paths run in parallel (each path's newline exists only once its path has
ended). Its position stays the published G + L_i + 1. With this mask,
decoding one token at a time over the whole sequence gives what an engine
that runs the paths in parallel gives.

Malformed sequences raise ValueError: a block left open at the end (unless
``allow_open``, for a sequence still being decoded), a goal close, path
tag or after-tag outside the place its block has for it, a block opened
inside a block in a format that does not nest (NPR), or, in a format that
nests, anywhere but inside a path.

`forced_mask` says which tokens of an answer the engine forced rather than
the model sampled: the ``"\\n"`` after a goal close, each path's header
(``"<step>\\n{label}:"``), the ``"\\n"`` after each path's close and the
after-tag with its ``"\\n"``.

The module is pure Python but for the tensors (`parallel_layout`,
`prefill_layout`, `attention_mask`), which import torch when called.
"""

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LayoutTags:
    """The token ids the layout reads (each tag must be one token)."""
    # The block's first tag: NPR `<guideline>`, Multiverse `<Parallel>`.
    block_open: int
    # NPR `</guideline>`, Multiverse `</Goal>`: G is its position.
    goal_close: int
    # NPR `<step>`, Multiverse `<Path>`.
    path_open: int
    # NPR `</step>`, Multiverse `</Path>`.
    path_close: int
    # NPR `<takeaway>`, Multiverse `<Conclusion>`.
    after_open: int
    # The "\n" token.
    newline: int
    # The last token of a path's header ("<step>\n{label}:"): ":".
    header_end: int
    # Multiverse `</Parallel>` (the block ends there); None for NPR, whose
    # block ends at its after-tag.
    block_close: Optional[int] = None
    # Whether a block may open inside a path (Multiverse).
    nests: bool = False


@dataclass
class Path:
    """One path of a block, by indices into the sequence."""
    # The index of its open tag.
    start: int
    # One past its span's last index (its close tag, or the "\n" after
    # it); None while it is open.
    end: Optional[int] = None
    # The index of its close tag; None while it is open.
    close: Optional[int] = None


@dataclass
class Block:
    """One block of a sequence, by indices into it."""
    # The index of its open tag.
    start: int
    # Its nesting depth (0: top level).
    depth: int
    # The index and position of its goal close (None before it).
    goal_close: Optional[int] = None
    goal_position: Optional[int] = None
    paths: list[Path] = field(default_factory=list)
    # The index of its after-tag and of its close tag (None before them).
    after: Optional[int] = None
    close: Optional[int] = None
    # The block whose path holds this one (None at top level).
    parent: Optional["Block"] = None
    # Where it stands: "goal", "paths", "in_path", "after", "closed".
    state: str = "goal"
    # The longest L_i so far.
    longest: int = 0


@dataclass(frozen=True)
class Layout:
    """A sequence's layout: a position per token and its blocks."""
    positions: list[int]
    blocks: list[Block]

    def hidden_pairs(self) -> list[tuple[range, range]]:
        """The pairs of spans that do not see each other (the later one's
        indices first), one pair per two paths of one block."""
        pairs = []
        for block in self.blocks:
            spans = [
                range(p.start, p.end if p.end is not None else len(self))
                for p in block.paths
            ]
            for b, later in enumerate(spans):
                pairs += [(later, earlier) for earlier in spans[:b]]
        return pairs

    def visible(self) -> list[list[bool]]:
        """The mask as lists: ``visible()[q][k]`` is whether the token at
        index q sees the one at index k."""
        rows = [[k <= q for k in range(len(self))] for q in range(len(self))]
        for later, earlier in self.hidden_pairs():
            for q in later:
                for k in earlier:
                    rows[q][k] = rows[k][q] = False
        return rows

    def __len__(self) -> int:
        return len(self.positions)


def parse_layout(ids: list[int],
                 tags: LayoutTags,
                 start: int = 0,
                 allow_open: bool = False) -> Layout:
    """The positions and blocks of ``ids`` under the layout (module doc).

    Args:
        ids: The token ids: prompt and answer.
        tags: The format's tag ids.
        start: Tokens before this index are read as plain tokens (NPR's
            training starts after the system prompt's first
            ``<|im_end|>``, which names the tags).
        allow_open: Accept blocks still open at the end (a sequence being
            decoded); its open paths' spans run to the end.

    Returns:
        The layout.

    Raises:
        ValueError: On a malformed sequence (module doc), naming the index.
    """
    positions: list[int] = []
    blocks: list[Block] = []
    stack: list[Block] = []
    for i, token in enumerate(ids):
        position = positions[-1] + 1 if positions else 0
        top = stack[-1] if stack else None
        if i < start:
            positions.append(i)
            continue
        if (top is not None and top.state == "paths" and top.paths
                and top.paths[-1].close == i - 1 and token == tags.newline):
            top.paths[-1].end = i + 1
        elif token == tags.block_open:
            if top is not None and not tags.nests:
                raise ValueError(f"a block opens at index {i} inside the "
                                 f"block opened at {top.start}, in a format "
                                 f"that does not nest")
            if top is not None and top.state != "in_path":
                raise ValueError(f"a block opens at index {i} inside the "
                                 f"block opened at {top.start} outside its "
                                 f"paths")
            block = Block(start=i, depth=len(stack), parent=top)
            blocks.append(block)
            stack.append(block)
        elif token == tags.goal_close:
            _expect(top, "goal", i, "a goal close")
            top.goal_close, top.goal_position = i, position
            top.state = "paths"
        elif token == tags.path_open:
            _expect(top, "paths", i, "a path")
            position = top.goal_position + 1
            top.paths.append(Path(start=i))
            top.state = "in_path"
        elif token == tags.path_close:
            _expect(top, "in_path", i, "a path close")
            top.longest = max(top.longest, position - top.goal_position)
            top.paths[-1].close, top.paths[-1].end = i, i + 1
            top.state = "paths"
        elif token == tags.after_open:
            _expect(top, "paths", i, "an after-tag")
            position = top.goal_position + top.longest + 1
            top.after = i
            if tags.block_close is None:
                top.state = "closed"
                stack.pop()
            else:
                top.state = "after"
        elif tags.block_close is not None and token == tags.block_close:
            _expect(top, "after", i, "a block close")
            top.close, top.state = i, "closed"
            stack.pop()
        positions.append(position)
    if stack and not allow_open:
        raise ValueError(f"the block opened at index {stack[-1].start} is "
                         f"not closed ({stack[-1].state})")
    return Layout(positions, blocks)


def _expect(top: Optional[Block], state: str, i: int, what: str) -> None:
    if top is None:
        raise ValueError(f"{what} at index {i} outside any block")
    if top.state != state:
        raise ValueError(f"{what} at index {i} in the block opened at "
                         f"{top.start}, whose state is {top.state!r}, not "
                         f"{state!r}")


def attention_mask(layout: Layout,
                   additive: bool = True,
                   dtype: Optional["torch.dtype"] = None) -> "torch.Tensor":
    """The layout's 4-D attention mask, shape [1, 1, L, L].

    Args:
        layout: The sequence's layout.
        additive: A float mask, 0 where a token sees another and the
            dtype's lowest value where it does not (what transformers adds
            to the attention scores); else a bool mask, True where it sees.
        dtype: The float mask's dtype (default float32).

    Returns:
        The mask; row q is what the token at index q sees.
    """
    import torch
    index = torch.arange(len(layout))
    sees = index[:, None] >= index[None, :]
    for later, earlier in layout.hidden_pairs():
        sees[later.start:later.stop, earlier.start:earlier.stop] = False
        sees[earlier.start:earlier.stop, later.start:later.stop] = False
    sees = sees[None, None]
    if not additive:
        return sees
    dtype = dtype or torch.float32
    return torch.zeros(sees.shape,
                       dtype=dtype).masked_fill(~sees,
                                                torch.finfo(dtype).min)


def parallel_layout(
    ids: list[int],
    tags: LayoutTags,
    start: int = 0,
    allow_open: bool = False,
    additive: bool = True,
    dtype: Optional["torch.dtype"] = None
) -> tuple["torch.Tensor", "torch.Tensor"]:
    """The position ids and 4-D attention mask of ``ids`` under the layout
    (module doc), as transformers' models take them.

    Args:
        ids: The token ids: prompt and answer.
        tags: The format's tag ids.
        start: See `parse_layout`.
        allow_open: See `parse_layout`.
        additive: See `attention_mask`.
        dtype: See `attention_mask`.

    Returns:
        Position ids (long, [1, L]) and the mask ([1, 1, L, L]).

    Raises:
        ValueError: On a malformed sequence.
    """
    import torch
    layout = parse_layout(ids, tags, start, allow_open)
    return (torch.tensor([layout.positions], dtype=torch.long),
            attention_mask(layout, additive, dtype))


def prefill_layout(
    ids: list[int],
    tags: Optional[LayoutTags] = None,
    start: int = 0,
    allow_open: bool = False,
    additive: bool = True,
    dtype: Optional["torch.dtype"] = None
) -> tuple["torch.Tensor", "torch.Tensor"]:
    """What a join that concatenates the paths and prefills them gives:
    positions 0, 1, 2, ... and a plain causal mask (later paths see
    earlier ones). The signature is `parallel_layout`'s; ``tags``,
    ``start`` and ``allow_open`` are not read.

    Returns:
        Position ids (long, [1, L]) and the mask ([1, 1, L, L]).
    """
    import torch
    layout = Layout(list(range(len(ids))), [])
    return (torch.tensor([layout.positions], dtype=torch.long),
            attention_mask(layout, additive, dtype))


def forced_mask(ids: list[int],
                prompt_len: int,
                tags: LayoutTags,
                start: int = 0) -> list[bool]:
    """Which tokens of ``ids`` the engine forced, read from the layout
    alone: for every block after the prompt, the "\\n" after its goal
    close, each path's header (its open tag through the first
    ``tags.header_end`` after it, i.e. ``"<step>\\n{label}:"``), the "\\n"
    after each path's close and the after-tag with the "\\n" after it.
    Every block is taken as forked: one the model wrote out itself (no
    fork) is marked the same.

    Args:
        ids: The token ids: prompt and answer.
        prompt_len: The prompt's length (its tokens are never forced).
        tags: The format's tag ids.
        start: See `parse_layout`.

    Returns:
        Per token, True if the engine forced it; the model sampled every
        token from ``prompt_len`` on that is not forced.

    Raises:
        ValueError: On a malformed sequence, or a path with no header end.
    """
    layout = parse_layout(ids, tags, start, allow_open=True)
    forced = [False] * len(ids)

    def force_newline(index: Optional[int]) -> None:
        if index is not None and index + 1 < len(ids) and ids[
                index + 1] == tags.newline:
            forced[index + 1] = True

    for block in layout.blocks:
        force_newline(block.goal_close)
        for path in block.paths:
            end = path.start
            while end < len(ids) and ids[end] != tags.header_end:
                end += 1
            if end == len(ids):
                raise ValueError(f"the path at index {path.start} has no "
                                 f"header end")
            forced[path.start:end + 1] = [True] * (end + 1 - path.start)
            if path.close is not None and path.end == path.close + 2:
                forced[path.close + 1] = True
        if block.after is not None:
            forced[block.after] = True
            force_newline(block.after)
    return [f and i >= prompt_len for i, f in enumerate(forced)]


@dataclass(frozen=True)
class ParallelFormat:
    """A fork/join format as the engine runs it: its tags as text, where
    it reads its labels, and the text it forces."""
    name: str
    # The tags (`LayoutTags` has their roles).
    block_open: str
    goal_close: str
    path_open: str
    path_close: str
    after_open: str
    block_close: Optional[str]
    nests: bool
    # Labels are read in the text after the last `goal_open`, as the
    # regex `plan_open` "\s*([0-9]+(?:\.[0-9]+)*)\s*:" matches them.
    goal_open: str
    plan_open: str
    # A goal close with more labels than this, or none, forks no path.
    max_paths: int = 5

    def labels(self, text: str) -> list[str]:
        """The labels of the goal that ``text`` ends in, in order, not
        de-duplicated ([] if ``text`` holds no `goal_open`)."""
        at = text.rfind(self.goal_open)
        if at < 0:
            return []
        pattern = re.escape(self.plan_open) + r"\s*([0-9]+(?:\.[0-9]+)*)\s*:"
        return re.findall(pattern, text[at:])

    def header(self, label: str) -> str:
        """A path's forced header: ``"<step>\\n{label}:"``."""
        return f"{self.path_open}\n{label}:"

    def after_text(self) -> str:
        """The forced text after a block's paths: ``"<takeaway>\\n"``."""
        return f"{self.after_open}\n"

    def tags(self, tokenizer) -> LayoutTags:
        """The tag ids of ``tokenizer`` (a transformers tokenizer).

        Raises:
            ValueError: If a tag, "\\n" or ":" is not one token.
        """

        def one(text: str) -> int:
            found = tokenizer.encode(text, add_special_tokens=False)
            if len(found) != 1:
                raise ValueError(f"{text!r} is {len(found)} tokens, not one")
            return found[0]

        return LayoutTags(block_open=one(self.block_open),
                          goal_close=one(self.goal_close),
                          path_open=one(self.path_open),
                          path_close=one(self.path_close),
                          after_open=one(self.after_open),
                          newline=one("\n"),
                          header_end=one(":"),
                          block_close=(None if self.block_close is None else
                                       one(self.block_close)),
                          nests=self.nests)


# By field: name, block_open, goal_close, path_open, path_close,
# after_open, block_close, nests, goal_open, plan_open.
NPR = ParallelFormat("npr", "<guideline>", "</guideline>", "<step>", "</step>",
                     "<takeaway>", None, False, "<guideline>", "<plan>")
MULTIVERSE = ParallelFormat("multiverse", "<Parallel>", "</Goal>", "<Path>",
                            "</Path>", "<Conclusion>", "</Parallel>", True,
                            "<Goal>", "<Outline>")
FORMATS = {f.name: f for f in (NPR, MULTIVERSE)}
