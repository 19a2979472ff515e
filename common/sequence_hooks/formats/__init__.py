# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fork/join formats as plug-ins: what a model writes to fork and join.

A format is a `Format`: its name, its options (checked at start), its tags
by role (each one token of the model, replaceable by ``format_tags``), the
capabilities it needs from an engine, and ``policy``, which makes the
decisions of its trees for the coordinator
(`sequence_hooks.lifecycle.Coordinator`: the records, aborts and trees
every format shares). Its name is ``special_kwargs``' ``format``.

Formats are registered by `register_format`: the built-in ones
(`BUILT_IN`, each one module with a ``FORMAT``) and every entry point of
the group ``sequence_hooks.formats`` that installed distributions declare,
each naming a `Format`, as vLLM's own plugins are found::

    [project.entry-points."sequence_hooks.formats"]
    my_format = "my_package.my_format:FORMAT"

Engines declare the capabilities they carry out (`ENGINE_CAPABILITIES`
lists each); an engine serves a format whose needs it covers and refuses
any other at start, naming what it lacks (`refusal_for`). docs/formats.md,
"Adding a format", works one through.

This module imports no format and no vLLM module: the registry is read by
`SpecialKwargs`, which the V0 fork's `vllm.config` imports partway through
`import vllm`.
"""

import importlib
import importlib.metadata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

# The group a distribution declares its formats in.
ENTRY_POINT_GROUP = "sequence_hooks.formats"
# The formats this package brings, each module's ``FORMAT``.
BUILT_IN = ("sequence_hooks.formats.promise_sync",
            "sequence_hooks.formats.threadweaver",
            "sequence_hooks.formats.apr", "sequence_hooks.formats.npr",
            "sequence_hooks.formats.multiverse")

# What an engine may carry out, beyond starting a tree, reporting it and
# aborting its members, which every engine does: each capability by name,
# with what it is.
FORK = "fork"
PARK_RESUME = "park_resume"
BRANCH_STOPS = "branch_stops"
CONCLUDE = "conclude"
RESTART = "restart"
FRESH_CHILDREN = "fresh_children"
HELD_OUTPUT = "held_output"
ARRIVALS = "arrivals"
SPLICE = "splice"
ENGINE_CAPABILITIES = {
    FORK: ("a child on its parent's KV cache, its context the parent's "
           "whole one and a few tokens of the format's"),
    PARK_RESUME: ("a member parked with its KV cache and resumed with "
                  "tokens appended, computing only those"),
    BRANCH_STOPS: ("a child that stops at the format's own token ids "
                   "besides its request's"),
    CONCLUDE: ("a member ended with tokens appended to its output, "
               "uncomputed"),
    RESTART:
    "a member's next call from a new prompt under its request id",
    FRESH_CHILDREN: ("a child from a fresh prompt that shares nothing with "
                     "its parent"),
    HELD_OUTPUT: ("a root's output held back until its tree ends, then "
                  "given whole"),
    ARRIVALS:
    "every request reported at its arrival, its tree started there",
    SPLICE: ("a join that reuses its paths' computed KV, each path at "
             "positions of its own, and computes only the closing tokens"),
}


@dataclass(frozen=True)
class FormatSetting:
    """What a format's policy is made with, on one engine.

    Args:
        special_kwargs: The configuration (`SpecialKwargs`), resolved to
            ids: its limits, ``format_tags`` applied through ``tags``.
        options: The format's options, checked (an instance of
            `Format.options`; None for a format that takes none).
        tags: The format's tag strings by role, ``format_tags`` applied.
        tokenizer: The engine's (Hugging Face) tokenizer.
        max_model_len: The engine's longest sequence.
    """

    special_kwargs: Any
    options: Any
    tags: Mapping[str, str]
    tokenizer: Any
    max_model_len: int


@dataclass(frozen=True)
class Format:
    """A fork/join format, as the registry holds it.

    Args:
        name: What ``special_kwargs``' ``format`` names it by.
        policy: Makes its policy (`sequence_hooks.lifecycle.FormatPolicy`)
            for a coordinator: ``policy(coordinator, setting)``.
        needs: The engine capabilities its policy's actions call for
            (`ENGINE_CAPABILITIES`' keys).
        tags: Its tag strings by role, each one token of its models.
        options: A pydantic dataclass of its options (``format_options``,
            checked at start, unknown keys refused); None: it takes none.
        reads_hook_tokens: Whether it reads ``special_kwargs``' own hook
            tokens (``sync_token`` ...), as promise/sync does; a format
            that does not refuses them.
        check: Its own start check of ``special_kwargs`` (raising
            ValueError with the reason); None: none.
        summary: One line users read in the list of formats.
    """

    name: str
    policy: Callable[[Any, FormatSetting], Any]
    needs: frozenset[str]
    tags: Mapping[str, str] = field(default_factory=dict)
    options: Optional[type] = None
    reads_hook_tokens: bool = False
    check: Optional[Callable[[Any], None]] = None
    summary: str = ""

    def __post_init__(self) -> None:
        unknown = set(self.needs) - set(ENGINE_CAPABILITIES)
        if unknown:
            raise ValueError(f"format {self.name!r} needs unknown "
                             f"capabilities {sorted(unknown)} (known: "
                             f"{sorted(ENGINE_CAPABILITIES)})")

    def read_options(self, given: Optional[Mapping[str, Any]]) -> Any:
        """Its options from ``format_options``, checked.

        Args:
            given: ``format_options`` as given; None: the defaults.

        Returns:
            An instance of `options`, or None for a format without any.

        Raises:
            ValueError: for options it does not take or their values.
        """
        if self.options is None:
            if given:
                raise ValueError(f"format {self.name!r} takes no "
                                 f"format_options, got {sorted(given)}")
            return None
        return self.options(**(given or {}))


# Formats by name, once loaded (`_load`).
_FORMATS: dict[str, Format] = {}
_LOADED = False


def register_format(fmt: Format) -> Format:
    """Registers a format in this process (what the built-ins and the
    entry points go through; a format in a package of its own declares an
    entry point instead, so every engine process finds it).

    Args:
        fmt: The format.

    Returns:
        ``fmt``, so a module may write ``FORMAT = register_format(...)``.

    Raises:
        ValueError: if another format has its name.
    """
    known = _FORMATS.get(fmt.name)
    if known is not None and known is not fmt:
        raise ValueError(f"format {fmt.name!r} is registered twice")
    _FORMATS[fmt.name] = fmt
    return fmt


def format_named(name: str) -> Format:
    """The registered format ``name``.

    Raises:
        ValueError: for an unknown one (the known ones named).
    """
    _load()
    if name in _FORMATS:
        return _FORMATS[name]
    known = ", ".join(_FORMATS)
    raise ValueError(f"unknown format {name!r} (known: {known})")


def format_names() -> list[str]:
    """The registered formats' names, built-ins first."""
    _load()
    return list(_FORMATS)


def refusal_for(fmt: Format, capabilities: frozenset[str]) -> Optional[str]:
    """Why an engine that carries out ``capabilities`` cannot serve
    ``fmt``; None if it can.

    Args:
        fmt: The format.
        capabilities: What the engine carries out (`ENGINE_CAPABILITIES`'
            keys).

    Returns:
        The reason, naming each missing capability, or None.
    """
    missing = sorted(set(fmt.needs) - set(capabilities))
    if not missing:
        return None
    lacks = "; ".join(f"{name} ({ENGINE_CAPABILITIES[name]})"
                      for name in missing)
    return (f"format {fmt.name!r} is not served by this engine, which "
            f"does not carry out {lacks}")


def _load() -> None:
    """Registers the built-ins and the entry points, once a process."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for module in BUILT_IN:
        register_format(importlib.import_module(module).FORMAT)
    for entry_point in importlib.metadata.entry_points(
            group=ENTRY_POINT_GROUP):
        fmt = entry_point.load()
        if not isinstance(fmt, Format):
            raise TypeError(f"entry point {entry_point.name!r} of group "
                            f"{ENTRY_POINT_GROUP!r} names "
                            f"{type(fmt).__name__}, not a Format")
        register_format(fmt)
