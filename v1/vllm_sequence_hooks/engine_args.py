# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The hooks' one setting, as on the V0 fork: `vllm serve --special-kwargs`
and `LLM(model, special_kwargs=...)` (or `EngineArgs`, `AsyncEngineArgs`).

vLLM has no hook through which a plugin adds an engine argument. It does
load general plugins (`vllm.general_plugins`, v1/pyproject.toml) in every
process before it builds engine arguments: `AsyncEngineArgs.add_cli_args`
loads them before it adds the engine's flags (upstream's comment there:
plugins may update the parser). `register`, that entry point, wraps four
members of `EngineArgs` in memory, each a row of `seams.SEAMS`:

- `add_cli_args` adds `--special-kwargs`, its JSON checked as it is
  parsed (an unknown key or a missing promise token is a usage error);
- `from_cli_args`, which every `vllm serve` process calls with the parsed
  arguments before it builds the app, expands it into the settings
  (`config.hooked_settings`), in place, so upstream reads plain flags
  from there on (`--middleware` in `build_app`, the arguments pickled for
  more API servers), and on a hooked API server turns on what shows the
  engine core's metrics on `/metrics` (`server_metrics`);
- `__init__` (of `EngineArgs` and `AsyncEngineArgs`) takes
  `special_kwargs=` and expands it the same way;
- `create_engine_config` checks the hooks against the model (each token
  string one token of its tokenizer, no EOS, a tokenizer at all) in the
  calling process, before any engine process starts.

Without hooks each wrapper calls upstream's member and does nothing
else. `LLM(model, special_kwargs=...)` builds `EngineArgs` before vLLM
loads any plugin: `import vllm_sequence_hooks` registers first (users
import it for `promise_tree` anyway); without the import, `special_kwargs`
is an unknown keyword (`TypeError`). Could go upstream as a way for
plugins to declare engine arguments; then this module goes.
"""

import argparse
import functools
from typing import Any, Callable

from vllm_sequence_hooks.config import (CAPABILITIES, CONFIG_KEY,
                                        hooked_settings, refuse_unservable,
                                        special_kwargs_of)
from vllm_sequence_hooks.server_metrics import show_engine_core_metrics
from vllm_sequence_hooks.splicing import use_splice_worker

from sequence_hooks.formats import SPLICE, format_named
from sequence_hooks.special_kwargs import (checked_special_kwargs, fields_of,
                                           refusal_reason)
from vllm.config import VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

FLAG = "--special-kwargs"
# The parsed arguments' attribute that holds the flag's value (a dict).
DEST = "special_kwargs"
# Its help group (`vllm serve --help=SequenceHooks`).
HELP_GROUP = "SequenceHooks"
# Marks a member this module wrapped, so `register` wraps once a process.
_WRAPPED = "__sequence_hooks_wrapped__"
# What the flag sets (`hooked_settings`) on a server.
SERVER_SETTINGS = ("scheduler_cls", "additional_config", "logits_processors",
                   "middleware")


class SpecialKwargsAction(argparse.Action):
    """Parses `--special-kwargs` JSON into its dict of fields, checked.

    The token strings are checked later, against the model's tokenizer
    (`create_engine_config`).
    """

    def __call__(self,
                 parser: argparse.ArgumentParser,
                 namespace: argparse.Namespace,
                 values: Any,
                 option_string: Any = None) -> None:
        try:
            parsed = checked_special_kwargs(values, capabilities=CAPABILITIES)
        except ValueError as e:
            # The reason without its "special_kwargs: " (argparse names
            # the flag).
            raise argparse.ArgumentError(self, refusal_reason(e.__cause__
                                                              or e)) from e
        setattr(namespace, self.dest, fields_of(parsed))


def add_flag(parser: argparse.ArgumentParser) -> None:
    """Adds `--special-kwargs` to a parser of engine arguments, in a group
    of its own, which `vllm serve --help` lists with the others."""
    group = parser.add_argument_group(
        HELP_GROUP, description=f"Promise/sync sequence hooks: {FLAG}.")
    group.add_argument(
        FLAG,
        dest=DEST,
        action=SpecialKwargsAction,
        default=None,
        help="Sequence hooks (vllm-sequence-hooks): the SpecialKwargs as "
        "JSON, e.g. '{\"sync_token\": \"<sync>\", \"promise_token\": "
        "\"<promise>\", \"child_role_token\": \"<child>\"}'. Turns the hooks "
        "on: the hooks' scheduler, configuration, request check and "
        "middleware (what --scheduler-cls, --additional-config, "
        "--logits-processors and --middleware would name). Your own "
        "--logits-processors and --middleware run beside them; another "
        "--scheduler-cls is refused.")


def expand_parsed_args(args: argparse.Namespace) -> None:
    """Expands a parsed `--special-kwargs` into the settings it stands for,
    in place; nothing without it. Applied twice, the same.

    Args:
        args: Parsed `vllm serve` (or other engine) arguments.

    Raises:
        ValueError: if a flag given beside it conflicts with it.
    """
    special_kwargs = getattr(args, DEST, None)
    if special_kwargs is None:
        return
    given = {name: getattr(args, name, None) for name in SERVER_SETTINGS}
    changed = hooked_settings(special_kwargs,
                              given,
                              server=hasattr(args, "middleware"))
    for name, value in changed.items():
        setattr(args, name, value)


def is_hooked_server(args: argparse.Namespace) -> bool:
    """Whether parsed arguments are those of an API server with hooks (not
    a headless engine host, whose metrics no `/metrics` shows)."""
    return (hasattr(args, "middleware")
            and not getattr(args, "headless", False)
            and CONFIG_KEY in (getattr(args, "additional_config", None) or {}))


def check_hooks_config(vllm_config: VllmConfig) -> None:
    """Checks a hooked configuration against its model, in the calling
    process; nothing without hooks.

    Raises:
        ValueError: if the hooks cannot run on it: a setting they cannot
            serve (`config.refuse_unservable`), a token string that is not
            one token, an id outside the vocabulary or the EOS token.
    """
    if CONFIG_KEY not in (vllm_config.additional_config or {}):
        return
    refuse_unservable(vllm_config)
    special_kwargs = special_kwargs_of(vllm_config)
    if SPLICE in format_named(special_kwargs.format).needs:
        use_splice_worker(vllm_config)


def _wrap(owner: type, name: str, make: Callable[[Callable],
                                                 Callable]) -> None:
    """Replaces ``owner.name`` with ``make(upstream's)``, once."""
    raw = owner.__dict__[name]
    upstream = raw.__func__ if isinstance(raw,
                                          (staticmethod, classmethod)) else raw
    if getattr(upstream, _WRAPPED, False):
        return
    wrapper = functools.wraps(upstream)(make(upstream))
    setattr(wrapper, _WRAPPED, True)
    if isinstance(raw, staticmethod):
        wrapper = staticmethod(wrapper)
    elif isinstance(raw, classmethod):
        wrapper = classmethod(wrapper)
    setattr(owner, name, wrapper)


def _add_cli_args(upstream: Callable) -> Callable:

    def add_cli_args(parser, *args, **kwargs):
        parser = upstream(parser, *args, **kwargs)
        add_flag(parser)
        return parser

    return add_cli_args


def _from_cli_args(upstream: Callable) -> Callable:

    def from_cli_args(cls, args: argparse.Namespace):
        expand_parsed_args(args)
        if is_hooked_server(args):
            show_engine_core_metrics()
        return upstream(cls, args)

    return from_cli_args


def _init(upstream: Callable) -> Callable:

    def __init__(self, *args, special_kwargs: Any = None, **kwargs):
        if special_kwargs is not None:
            kwargs.update(hooked_settings(special_kwargs, kwargs))
        upstream(self, *args, **kwargs)

    return __init__


def _create_engine_config(upstream: Callable) -> Callable:

    def create_engine_config(self, *args, **kwargs) -> VllmConfig:
        vllm_config = upstream(self, *args, **kwargs)
        check_hooks_config(vllm_config)
        return vllm_config

    return create_engine_config


def register() -> None:
    """The general plugin: adds `--special-kwargs` and `special_kwargs=`.

    vLLM runs it in each of its processes (and `import
    vllm_sequence_hooks` does); it wraps each member once.
    """
    _wrap(EngineArgs, "add_cli_args", _add_cli_args)
    _wrap(EngineArgs, "from_cli_args", _from_cli_args)
    _wrap(EngineArgs, "__init__", _init)
    _wrap(AsyncEngineArgs, "__init__", _init)
    _wrap(EngineArgs, "create_engine_config", _create_engine_config)
