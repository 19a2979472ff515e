# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""models/npr-toy and models/multiverse-toy as the model-free tests of the
splicing formats on the V1 scheduler read them: each toy's folder
(configuration and tokenizer; no weights are read), its tokenizer
and tags, its texts (a goal, a path's header), and a scripted greedy
model of a tree (`scripted`).
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

MODELS = Path(__file__).resolve().parents[3] / "models"
# Where a path's script ends: the token it samples after its forced
# newline, which its end drops (no script writes it otherwise).
PAD = "z"


@dataclass(frozen=True)
class SpliceToy:
    """A splicing format's toy: its format's name, folder, tokenizer and
    tags (one token each)."""

    name: str
    model: Path
    tokenizer: Any
    # Opens the block (Multiverse's "<Parallel>"; NPR has none).
    block_open: str
    # Opens and closes the goal (its closing tag forks).
    goal_open: str
    goal_close: str
    # Opens and closes a goal's entry ("<plan>1: cat</plan>").
    item_open: str
    item_close: str
    # Opens and closes a path.
    path_open: str
    path_close: str
    # Opens and closes what follows a block's paths.
    after_open: str
    after_close: str
    # Closes the block after that (Multiverse's "</Parallel>\n").
    block_close: str

    @property
    def eos(self) -> int:
        return self.tokenizer.eos_token_id

    def ids(self, text: str) -> list[int]:
        """The text's ids, no special tokens added."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def id_of(self, tag: str) -> int:
        """A tag's id (it is one token)."""
        (found, ) = self.ids(tag)
        return found

    def goal(self, entries: Sequence[str]) -> str:
        """A block's opening up to its goal's closing tag, one entry a
        line (``"1: cat"``)."""
        listed = "".join(f"{self.item_open}{entry}{self.item_close}\n"
                         for entry in entries)
        return (f"{self.block_open}{self.goal_open}\n{listed}"
                f"{self.goal_close}")

    def header(self, label: str) -> str:
        """A path's header, as the engine forks it."""
        return f"{self.path_open}\n{label}:"


TOYS = {
    "npr":
    SpliceToy("npr", MODELS / "npr-toy",
              AutoTokenizer.from_pretrained(MODELS / "npr-toy"), "",
              "<guideline>", "</guideline>", "<plan>", "</plan>", "<step>",
              "</step>", "<takeaway>", "</takeaway>", ""),
    "multiverse":
    SpliceToy("multiverse", MODELS / "multiverse-toy",
              AutoTokenizer.from_pretrained(MODELS / "multiverse-toy"),
              "<Parallel>\n", "<Goal>", "</Goal>", "<Outline>", "</Outline>",
              "<Path>", "</Path>", "<Conclusion>", "</Conclusion>",
              "</Parallel>\n"),
}


@dataclass(frozen=True)
class Node:
    """What one node of a tree writes, as ids: ``before`` from its start
    (a block's goal, if it forks one, then on if it does not fork), and
    ``after`` from its join's closing tokens on. Past its end it repeats
    its last token."""

    before: list[int]
    after: list[int]


def scripted(scheduler: Any, toy: SpliceToy,
             nodes: Mapping[str, Node]) -> Callable[[str, int], int]:
    """A scripted greedy model of trees on ``scheduler``, a
    `BatchQueueDriver`'s sampler: each request writes the script of its
    node, ``nodes[label]`` (``""`` for a root; a path's label is read
    from its header, which ends its prompt), one token a position.

    Args:
        scheduler: The scheduler the driver drives.
        toy: The format's toy.
        nodes: The nodes' scripts by label.

    Returns:
        The sampler: the token of a request at a position among its own.
    """
    path_open, after_open = toy.id_of(toy.path_open), toy.id_of(toy.after_open)

    def next_token(request_id: str, position: int) -> int:
        request = scheduler.requests[request_id]
        context = request.all_token_ids
        # The index the sampled token takes (in-flight steps included).
        at = request.num_computed_tokens
        start = at - position
        label = ""
        if "/promise-" in request_id:
            opened = start - 1 - context[start - 1::-1].index(path_open)
            label = toy.tokenizer.decode(context[opened + 2:start - 1])
        node = nodes[label]
        own = context[start:]
        if after_open in own:
            # After the node's join (the last closing tag: a nested
            # block's come with a path, before its parent's join).
            closing = len(context) - 1 - context[::-1].index(after_open)
            script, index = node.after, at - (closing + 2)
        else:
            script, index = node.before, position
        return script[min(index, len(script) - 1)]

    return next_token
