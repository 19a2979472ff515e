# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`SpecialKwargs`: the configuration of sequence hooks, and
`checked_special_kwargs`, the one reader and start check both engines run
on it, in every process that checks it.

Re-exported by the V0 fork's `vllm.config`, which imports it partway through
`import vllm`: it must not import any vLLM module.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

from pydantic import ConfigDict, TypeAdapter, model_validator
from pydantic.dataclasses import dataclass

from sequence_hooks.formats import format_named, refusal_for

# The hook roles: each is given as a token id or as a token string.
ROLES = ("sync", "promise", "child_role")
# What every refusal of a `special_kwargs` starts with.
REFUSAL = "special_kwargs: "
# The default fork/join format (`sequence_hooks.formats.promise_sync`).
PROMISE_SYNC = "promise_sync"


@dataclass(config=ConfigDict(extra="forbid", strict=True))
class SpecialKwargs:
    """Token ids and limits of sequence hooks.

    A sequence that samples the promise token spawns a child sequence that
    shares its context and KV cache; one that samples the sync token waits
    for its children, gets their output texts appended to its context and
    resumes. Setting this on an engine turns the hooks on. Each token is
    given either as an id (`sync_token_id`) or as a token string
    (`sync_token`), which the engine resolves through the model's tokenizer
    at start.
    """

    sync_token_id: Optional[int] = None
    """Token that blocks a sequence until its children have finished."""
    promise_token_id: Optional[int] = None
    """Token that spawns a child sequence."""
    child_role_token_id: Optional[int] = None
    """Token appended to each child's context right after the promise, so
    the model can tell a child from its parent. None: no marker."""
    sync_token: Optional[str] = None
    """The sync token as a string of the tokenizer, instead of its id."""
    promise_token: Optional[str] = None
    """The promise token as a string of the tokenizer, instead of its id."""
    child_role_token: Optional[str] = None
    """The role marker as a string of the tokenizer, instead of its id."""
    merge_separator: str = "\n"
    """Text placed between the output texts of merged children."""
    max_children_per_sequence: int = 16
    """Promises one sequence may make; later ones spawn nothing."""
    max_children_per_request: int = 64
    """Children one request may spawn over its whole tree."""
    max_depth: int = 2
    """Deepest nesting of children: 1 means children may not promise."""
    critical_path_first: bool = True
    """Under contention, schedule the work a parked tree waits for (children
    of parked parents, resumed parents) before new requests, and preempt it
    last. False: the stock scheduling order (under the priority policy,
    priority then arrival either way)."""
    max_steps_passed_over: int = 64
    """Engine steps a waiting request may be passed over by critical-path
    work; after that it goes first (the starvation bound)."""
    format: str = PROMISE_SYNC
    """The fork/join format the model writes: "promise_sync" (served by
    both engines, its tokens the fields above), or another registered
    format's name (`sequence_hooks.formats`: "threadweaver", "apr" and
    any a plug-in adds), which an engine that cannot carry out what it
    needs refuses at start (`checked_special_kwargs`)."""
    format_tags: Optional[dict[str, str]] = None
    """A format's tag strings by role, replacing its own (`Format.tags`),
    for a model trained with other tags; each must be one token."""
    format_options: Optional[dict[str, Any]] = None
    """The format's own options (`Format.options`), checked at start."""

    def fork_limit(self, num_spawned: int) -> int:
        """Children one fork of a format may start, in a tree that has
        spawned ``num_spawned``: `max_children_per_sequence`, within what
        is left of `max_children_per_request`."""
        return max(
            min(self.max_children_per_sequence,
                self.max_children_per_request - num_spawned), 0)

    @property
    def tags(self) -> dict[str, str]:
        """The format's tags by role, with ``format_tags`` applied."""
        return {**format_named(self.format).tags, **(self.format_tags or {})}

    @model_validator(mode="after")
    def _check(self) -> "SpecialKwargs":
        fmt = format_named(self.format)
        if not fmt.reads_hook_tokens:
            given = [
                f"{role}_token{suffix}" for role in ROLES
                for suffix in ("", "_id")
                if getattr(self, f"{role}_token{suffix}") is not None
            ]
            if given:
                raise ValueError(f"format {self.format!r} reads its own "
                                 f"tags: {', '.join(given)} given beside it "
                                 f"belong to {PROMISE_SYNC}")
        unknown = set(self.format_tags or {}) - set(fmt.tags)
        if unknown and not fmt.tags:
            raise ValueError("format_tags belong to a format's tags; "
                             f"format {self.format!r} has none")
        if unknown:
            raise ValueError(f"format {self.format!r} has no tag role(s) "
                             f"{sorted(unknown)} (its roles: "
                             f"{sorted(fmt.tags)})")
        fmt.read_options(self.format_options)
        if fmt.check is not None:
            fmt.check(self)
        for name in ("max_children_per_sequence", "max_children_per_request",
                     "max_depth", "max_steps_passed_over"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"{name} must be >= 1, got {getattr(self, name)}")
        return self

    def _ids(self) -> dict[str, int]:
        return {
            f"{role}_token_id": getattr(self, f"{role}_token_id")
            for role in ROLES if getattr(self, f"{role}_token_id") is not None
        }

    @classmethod
    def parse(cls, value: Any) -> "SpecialKwargs":
        """Reads what either engine takes as `special_kwargs`: a
        SpecialKwargs, a dict of its fields or its JSON.

        Raises:
            ValueError: on another type, invalid JSON, unknown keys, wrong
                types or values.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls.from_json(value)
        if isinstance(value, dict):
            return cls(**value)
        raise ValueError("special_kwargs must be SpecialKwargs, a dict or "
                         f"its JSON, not {type(value).__name__}")

    @classmethod
    def from_json(cls, text: str) -> "SpecialKwargs":
        """Reads the JSON that `--special-kwargs` takes.

        Raises:
            ValueError: on invalid JSON, unknown keys, wrong types or values.
        """
        return TypeAdapter(cls).validate_json(text)

    @property
    def is_resolved(self) -> bool:
        """Whether every token is given by id (no string left to look up)."""
        return all(getattr(self, f"{role}_token") is None for role in ROLES)

    def resolve(self, tokenizer: Any) -> "SpecialKwargs":
        """Returns a copy with token strings replaced by their ids.

        Args:
            tokenizer: The model's (Hugging Face) tokenizer.

        Raises:
            ValueError: if a string is not exactly one token of the
                tokenizer.
        """
        changes: dict[str, Optional[int]] = {}
        for role in ROLES:
            token = getattr(self, f"{role}_token")
            if token is None:
                continue
            token_id = tokenizer.convert_tokens_to_ids(token)
            if (not isinstance(token_id, int)
                    or tokenizer.convert_ids_to_tokens(token_id) != token):
                pieces = tokenizer.tokenize(token)
                raise ValueError(
                    f"{role}_token {token!r} is not a single token of the "
                    f"model's tokenizer (it splits into {pieces!r})")
            changes[f"{role}_token_id"] = token_id
            changes[f"{role}_token"] = None
        return dataclasses.replace(self, **changes)

    @property
    def hook_token_ids(self) -> frozenset[int]:
        """The ids this configuration gives a meaning to (once resolved)."""
        if not self.is_resolved:
            raise ValueError("special_kwargs has token strings left; "
                             "resolve them with the tokenizer first")
        return frozenset(self._ids().values())

    def for_model(self, tokenizer: Callable[[], Any], vocab_size: int,
                  eos_token_id: Any) -> "SpecialKwargs":
        """This configuration checked against a model, the one check both
        engines run at start: token strings resolved to ids, every id in
        the vocabulary, none the model's end of sequence.

        Args:
            tokenizer: Loads the model's tokenizer (called only if a token
                is given as a string).
            vocab_size: The model's vocabulary size.
            eos_token_id: The model config's `eos_token_id`: an id, a list
                of ids or None.

        Returns:
            The configuration with every token given by id.

        Raises:
            ValueError: naming the token that does not fit the model.
        """
        resolved = self if self.is_resolved else self.resolve(tokenizer())
        for role, tag in self.tags.items():
            found = tokenizer().encode(tag, add_special_tokens=False)
            if len(found) != 1:
                raise ValueError(f"format {self.format!r}: its {role} tag "
                                 f"{tag!r} is not one token of the model "
                                 f"(it encodes as {found})")
        resolved._check_vocab_size(vocab_size)
        resolved._check_not_eos(eos_token_id)
        return resolved

    def _check_not_eos(self, eos_token_id: Any) -> None:
        """Raises ValueError if a hook token is the model's end of sequence
        (the engine would stop where the hook should act).

        Args:
            eos_token_id: The model config's `eos_token_id`: an id, a list
                of ids or None.
        """
        eos = eos_token_id if isinstance(eos_token_id,
                                         list) else [eos_token_id]
        clashes = (set(eos) - {None}) & self.hook_token_ids
        if clashes:
            raise ValueError(f"token id(s) {sorted(clashes)} are the "
                             "model's end-of-sequence token")

    def _check_vocab_size(self, vocab_size: int) -> None:
        """Raises ValueError unless every hook token id is in the vocabulary.

        Args:
            vocab_size: The model's vocabulary size.
        """
        for token_id in sorted(self.hook_token_ids):
            if token_id >= vocab_size:
                raise ValueError(
                    f"special token id {token_id} is outside the model's "
                    f"vocabulary (size {vocab_size})")


@dataclasses.dataclass(frozen=True)
class ModelTokens:
    """What the start check reads of a model (`SpecialKwargs.for_model`).

    Args:
        tokenizer: Loads the model's tokenizer (called only if a token is
            given as a string).
        vocab_size: The model's vocabulary size.
        eos_token_id: The model config's `eos_token_id`: an id, a list of
            ids or None.
    """

    tokenizer: Callable[[], Any]
    vocab_size: int
    eos_token_id: Any


def fields_of(special_kwargs: SpecialKwargs) -> dict[str, Any]:
    """Every field of ``special_kwargs``, by name (what V1's
    `additional_config` carries: plain data, to JSON and back)."""
    return {
        name: getattr(special_kwargs, name)
        for name in SpecialKwargs.__dataclass_fields__
    }


# This process's readings (`read_special_kwargs`), by the repr of what was
# given and of the fields it reads as.
_READ: dict[str, SpecialKwargs] = {}


def read_special_kwargs(value: Any) -> SpecialKwargs:
    """Reads `special_kwargs` once a process: a value read before, or the
    fields it was read as (what V1 carries on in `additional_config`), is
    not parsed again.

    Args:
        value: A SpecialKwargs, a dict of its fields or its JSON.

    Returns:
        The configuration (the same object for the same setting).

    Raises:
        ValueError: as `SpecialKwargs.parse`; a refusal is not kept.
    """
    if isinstance(value, SpecialKwargs):
        return value
    # The repr tells apart every value `SpecialKwargs.parse` tells apart.
    key = repr(value)
    if key not in _READ:
        parsed = SpecialKwargs.parse(value)
        _READ[key] = _READ.setdefault(repr(fields_of(parsed)), parsed)
    return _READ[key]


def checked_special_kwargs(value: Any,
                           model: Optional[ModelTokens] = None,
                           *,
                           capabilities: frozenset[str]) -> SpecialKwargs:
    """Reads `special_kwargs` and checks it against the engine and
    ``model``: what every process that takes the setting runs (on V1 the
    API process, the engine core and the workers; on V0 the engine's
    start), so a bad setting gets the same reason wherever it is found.

    Args:
        value: A SpecialKwargs, a dict of its fields or its JSON.
        model: The model to check it against; None: read only (where no
            model is known yet).
        capabilities: What the calling engine carries out
            (`sequence_hooks.formats.ENGINE_CAPABILITIES`' keys): a
            format that needs more is refused, naming what is missing.

    Returns:
        The configuration; with ``model``, every token given by id.

    Raises:
        ValueError: `special_kwargs: ` and the reason, on one line.
    """
    try:
        parsed = read_special_kwargs(value)
        refusal = refusal_for(format_named(parsed.format), capabilities)
        if refusal is not None:
            raise ValueError(refusal)
        if model is None:
            return parsed
        return parsed.for_model(model.tokenizer, model.vocab_size,
                                model.eos_token_id)
    except ValueError as e:
        raise ValueError(REFUSAL + refusal_reason(e)) from e


def refusal_reason(error: Exception) -> str:
    """The reason of a refusal on one line (pydantic's take several), as
    `vllm serve` prints it last."""
    return " ".join(str(error).split())
