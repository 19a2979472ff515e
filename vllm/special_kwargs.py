# SPDX-License-Identifier: Apache-2.0
"""`SpecialKwargs`: the configuration of sequence hooks.

Re-exported by `vllm.config`, which imports this module partway through
`import vllm`: it must not import other vLLM modules.
"""

from typing import Optional

from pydantic import ConfigDict, model_validator
from pydantic.dataclasses import dataclass


@dataclass(config=ConfigDict(extra="forbid", strict=True))
class SpecialKwargs:
    """Token ids and limits of sequence hooks.

    A sequence that samples `promise_token_id` spawns a child sequence that
    shares its context and KV cache; one that samples `sync_token_id` waits
    for its children, gets their output texts appended to its context and
    resumes. Setting this on an engine turns the hooks on.
    """

    sync_token_id: int
    """Token that blocks a sequence until its children have finished."""
    promise_token_id: int
    """Token that spawns a child sequence."""
    child_role_token_id: Optional[int] = None
    """Token appended to each child's context right after the `<promise>`,
    so the model can tell a child from its parent. None: no marker."""
    merge_separator: str = "\n"
    """Text placed between the output texts of merged children."""
    max_children_per_sequence: int = 16
    """Promises one sequence may make; later ones spawn nothing."""
    max_children_per_request: int = 64
    """Children one request may spawn over its whole tree."""
    max_depth: int = 2
    """Deepest nesting of children: 1 means children may not promise."""

    @model_validator(mode="after")
    def _check(self) -> "SpecialKwargs":
        ids = {
            "sync_token_id": self.sync_token_id,
            "promise_token_id": self.promise_token_id,
        }
        if self.child_role_token_id is not None:
            ids["child_role_token_id"] = self.child_role_token_id
        for name, token_id in ids.items():
            if token_id < 0:
                raise ValueError(f"{name} must be >= 0, got {token_id}")
        if len(set(ids.values())) != len(ids):
            raise ValueError(f"special token ids must differ, got {ids}")
        for name in ("max_children_per_sequence", "max_children_per_request",
                     "max_depth"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"{name} must be >= 1, got {getattr(self, name)}")
        return self

    @property
    def hook_token_ids(self) -> frozenset[int]:
        """The ids this configuration gives a meaning to."""
        ids = {self.sync_token_id, self.promise_token_id}
        if self.child_role_token_id is not None:
            ids.add(self.child_role_token_id)
        return frozenset(ids)

    def check_vocab_size(self, vocab_size: int) -> None:
        """Raises ValueError unless every hook token id is in the vocabulary.

        Args:
            vocab_size: The model's vocabulary size.
        """
        for token_id in sorted(self.hook_token_ids):
            if token_id >= vocab_size:
                raise ValueError(
                    f"special token id {token_id} is outside the model's "
                    f"vocabulary (size {vocab_size})")
