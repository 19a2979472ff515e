# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checks the installed vLLM against the record of its seams.

Each seam of `seams.SEAMS` is looked up in the installed vLLM and compared
with the supported version's record: every name must exist, and where the
record has them, the signature, the source's sha256, the methods a
subclassed class defines and what a function reads of a stand-in must be
as recorded; a member the record says the version lacks must be absent.
A mismatch names the member and what changed. Each upstream method copied
into the plugin (`releases.VENDORED`) is checked against the upstream
method's recorded hashes (`check_vendored`).

As a command, for the upgrade to a new vLLM:

    python -m vllm_sequence_hooks.tripwires check     # every mismatch
    python -m vllm_sequence_hooks.tripwires record    # a new record (JSON)
    python -m vllm_sequence_hooks.tripwires markdown  # docs/seams.md's table
"""

import ast
import dataclasses
import difflib
import functools
import hashlib
import importlib
import importlib.resources
import inspect
import json
import sys
import textwrap
from typing import Any, Optional

from vllm_sequence_hooks.seams import (SEAMS, SUPPORTED_VLLM_VERSIONS,
                                       supported_version)
from vllm_sequence_hooks.seams_types import Expect, Seam, Vendored

# The records' folder in this package: `<version>.json` per supported
# release.
RECORDS = "records"


@functools.cache
def record(version: str) -> dict[str, Expect]:
    """What a supported vLLM version has of each seam, by member.

    Args:
        version: A supported release ("0.32.0").

    Returns:
        Its record, `records/<version>.json`.
    """
    path = importlib.resources.files(__package__) / RECORDS / f"{version}.json"
    members = json.loads(path.read_text())["members"]
    return {
        member:
        Expect(
            **{
                name: tuple(value) if name == "defines" else value
                for name, value in fields.items()
            })
        for member, fields in members.items()
    }


def split_member(member: str) -> tuple[str, str, tuple[str, ...]]:
    """`module:Owner.{a,b}` as (module, owner's qualified name, names);
    the owner is "" when the names are the module's own."""
    module, qualname = member.split(":")
    if qualname.endswith("}"):
        owner, names = qualname[:-1].split(".{")
        return module, owner, tuple(names.split(","))
    owner, _, name = qualname.rpartition(".")
    return module, owner, (name, )


def resolve(path: str) -> Any:
    """The object `module:Qualified.name` names (raises if it is gone)."""
    module, _, qualname = path.partition(":")
    found = importlib.import_module(module)
    for part in qualname.split(".") if qualname else ():
        found = getattr(found, part)
    return found


def instance_attributes(cls: type) -> set[str]:
    """Names a class's instances have that the class itself may not:
    fields (dataclass, msgspec, named tuple) and attributes its methods,
    or its vLLM base classes' methods, assign on `self`."""
    names: set[str] = set(getattr(cls, "__struct_fields__", ()))
    names |= set(getattr(cls, "_fields", ()))
    if dataclasses.is_dataclass(cls):
        names |= {field.name for field in dataclasses.fields(cls)}
    for base in cls.__mro__:
        if not base.__module__.startswith("vllm"):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node,
                                                   (ast.AnnAssign,
                                                    ast.AugAssign)) else [])
            names |= {
                target.attr
                for target in targets
                if isinstance(target, ast.Attribute) and isinstance(
                    target.value, ast.Name) and target.value.id == "self"
            }
    return names


def signature_text(obj: Any) -> str:
    """A callable's parameters: names in order, `=` after one with a
    default, `/` and `*` where positional-only and keyword-only ones end
    and begin (annotations and default values left out)."""
    parts: list[str] = []
    params = list(inspect.signature(obj).parameters.values())
    for i, param in enumerate(params):
        if (param.kind is param.KEYWORD_ONLY and params[i - 1].kind
                not in (param.KEYWORD_ONLY, param.VAR_POSITIONAL)):
            parts.append("*")
        prefix = {
            param.VAR_POSITIONAL: "*",
            param.VAR_KEYWORD: "**"
        }.get(param.kind, "")
        default = "=" if param.default is not param.empty else ""
        parts.append(f"{prefix}{param.name}{default}")
        if (param.kind is param.POSITIONAL_ONLY
                and (i + 1 == len(params)
                     or params[i + 1].kind is not param.POSITIONAL_ONLY)):
            parts.append("/")
    return f"({', '.join(parts)})"


def source_sha256(obj: Any) -> str:
    """sha256 of a function's or class's source, or of a value's repr."""
    if isinstance(obj, property):
        obj = obj.fget
    if not (inspect.isroutine(obj) or inspect.isclass(obj)):
        text = repr(obj)
    else:
        try:
            text = inspect.getsource(obj)
        except (OSError, TypeError) as error:
            # Compiled, or made at run time: not the recorded source.
            return f"unreadable ({error})"
    return hashlib.sha256(text.encode()).hexdigest()


def defined_methods(cls: type) -> tuple[str, ...]:
    """Methods and properties a class defines itself, sorted."""
    return tuple(
        sorted(name for name, value in vars(cls).items()
               if inspect.isroutine(value)
               or isinstance(value, (property, classmethod, staticmethod))))


def request_reads(function: Any) -> set[str]:
    """Attributes a function reads of the names `request` it uses."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {
        node.attr
        for node in ast.walk(tree) if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name) and node.value.id == "request"
    }


def hashed(seam: Seam) -> bool:
    """Whether a seam's source is recorded: a method we override, code we
    rely on without calling it, or a private method we call."""
    _, _, names = split_member(seam.member)
    return ("overrides" in seam.kind or "relies on" in seam.kind
            or (seam.kind == "calls" and names[0].startswith("_")))


def lookup(seam: Seam) -> tuple[dict[str, Any], list[str]]:
    """The seam's members in the installed vLLM, by name (None for an
    instance attribute), and the names that are gone."""
    module, owner_name, names = split_member(seam.member)
    try:
        owner = resolve(f"{module}:{owner_name}")
    except (ImportError, AttributeError) as error:
        return {}, [f"{module}:{owner_name} ({error})"]
    found: dict[str, Any] = {}
    missing: list[str] = []
    attributes = (instance_attributes(owner)
                  if inspect.isclass(owner) else set())
    for name in names:
        if hasattr(owner, name):
            found[name] = getattr(owner, name)
        elif name in attributes:
            found[name] = None
        else:
            missing.append(name)
    return found, missing


def current(seam: Seam) -> Expect:
    """What the installed vLLM has of a seam, in a record's form."""
    found, missing = lookup(seam)
    if missing and not found:
        return Expect(absent=True)
    if missing:
        raise LookupError(f"{seam.member}: gone: {', '.join(missing)}")
    names = split_member(seam.member)[2]
    if len(names) > 1:
        return Expect()
    obj = found[names[0]]
    if obj is None:
        return Expect()
    if not callable(obj) or isinstance(obj, property):
        return Expect(
            source_sha256=source_sha256(obj) if hashed(seam) else None)
    if "annotates" in seam.kind:
        return Expect()
    if seam.kind == "wraps":
        # A wrapper passes every argument on and calls upstream's member,
        # whose source is not ours to pin; what it assumes of the call is
        # in the signature (inspect follows the wrapper to upstream's).
        return Expect(signature=signature_text(obj))
    if "subclasses" in seam.kind:
        return Expect(defines=defined_methods(obj))
    return Expect(signature=signature_text(obj),
                  source_sha256=source_sha256(obj) if hashed(seam) else None)


def check(seam: Seam, version: str) -> list[str]:
    """What differs between the installed vLLM and ``version``'s record of
    a seam, each naming the member; empty if nothing does."""
    expect = record(version).get(seam.member)
    if expect is None:
        return [f"{seam.member}: no record for vLLM {version}"]
    found, missing = lookup(seam)
    if expect.absent:
        return [
            f"{seam.member}: vLLM {version} has none of it in its record, "
            f"the installed vLLM has {', '.join(found)}: record it"
        ] if found else []
    problems = [
        f"upstream lost {seam.member.split(':')[0]}:"
        f"{split_member(seam.member)[1]}.{name} ({seam.why})"
        for name in missing
    ]
    if missing:
        return problems
    obj = next(iter(found.values()))
    if expect.signature is not None and (signature_text(obj)
                                         != expect.signature):
        problems.append(f"{seam.member} changed signature: "
                        f"{expect.signature} in vLLM {version}, now "
                        f"{signature_text(obj)}")
    if expect.source_sha256 is not None and (source_sha256(obj)
                                             != expect.source_sha256):
        problems.append(f"{seam.member} changed source (sha256 "
                        f"{source_sha256(obj)}, {expect.source_sha256} in "
                        f"vLLM {version}): read upstream's diff; we rely on "
                        f"it: {seam.why}")
    if expect.defines is not None and (defined_methods(obj) != expect.defines):
        problems.append(f"{seam.member} defines {defined_methods(obj)}, "
                        f"in vLLM {version} {expect.defines}")
    for reader in seam.readers:
        extra = request_reads(resolve(reader)) - set(found)
        if extra:
            problems.append(f"{reader} reads {sorted(extra)} of its request: "
                            f"the stand-in of {seam.member} lacks them")
    return problems


def code(function: Any) -> str:
    """A function's code without comments or layout (`ast.unparse` of its
    source)."""
    return ast.unparse(ast.parse(textwrap.dedent(
        inspect.getsource(function)))) + "\n"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def check_vendored(vendored: Vendored, version: str) -> list[str]:
    """What differs between a copied upstream method, its recorded diff
    and the upstream method, each naming the copy; empty if nothing does.

    The copy's code with the diff undone must be the upstream method's
    (its recorded sha256); the record of the release copied from must
    hash the same source; where the installed vLLM (``version``) has the
    upstream method, it must be that source and code.
    """
    problems = []
    copy = code(resolve(vendored.copy))
    if vendored.diff:
        ours = "".join(difflib.restore(vendored.diff, 2))
        if ours != copy:
            problems.append(f"{vendored.copy} is not its recorded diff's "
                            f"copy of {vendored.upstream}: record its diff")
        upstream = "".join(difflib.restore(vendored.diff, 1))
    else:
        upstream = copy
    if _sha256(upstream) != vendored.code_sha256:
        problems.append(f"{vendored.copy} with its recorded diff undone is "
                        f"not vLLM {vendored.release}'s {vendored.upstream} "
                        f"(code sha256 {_sha256(upstream)}, recorded "
                        f"{vendored.code_sha256})")
    source = record(vendored.release)[vendored.upstream].source_sha256
    if source != vendored.source_sha256:
        problems.append(f"{vendored.copy} was copied from source sha256 "
                        f"{vendored.source_sha256}; vLLM {vendored.release}'s "
                        f"record has {source}")
    module, owner, names = split_member(vendored.upstream)
    try:
        installed = getattr(resolve(f"{module}:{owner}"), names[0])
    except (ImportError, AttributeError):
        return problems
    if source_sha256(installed) != vendored.source_sha256:
        problems.append(f"{vendored.upstream} in vLLM {version} is not the "
                        f"source {vendored.copy} was copied from")
    if _sha256(code(installed)) != vendored.code_sha256:
        problems.append(f"{vendored.upstream} in vLLM {version} is not the "
                        f"code {vendored.copy} was copied from")
    return problems


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """docs/seams.md's table of the V1 seams (from `SEAMS` and the newest
    supported version's record that has each; the versions that lack one
    are named)."""
    records = {version: record(version) for version in SUPPORTED_VLLM_VERSIONS}
    lines = [
        "| upstream member | module | kind | why | remove when | tripwire |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for seam in SEAMS:
        module, owner, names = split_member(seam.member)
        shown = ".".join(
            filter(None, [
                owner,
                names[0] if len(names) == 1 else "{" + ", ".join(names) + "}"
            ]))
        having = [
            version for version in SUPPORTED_VLLM_VERSIONS
            if not records[version][seam.member].absent
        ]
        expect = records[having[-1]][seam.member]
        wire = ", ".join(label for label, on in (
            ("signature", expect.signature is not None),
            ("source", expect.source_sha256 is not None),
            ("own methods", expect.defines is not None),
            ("reads only these", bool(seam.readers)),
        ) if on) or "exists"
        if len(having) < len(SUPPORTED_VLLM_VERSIONS):
            wire += f" (vLLM {', '.join(having)} only)"
        lines.append(f"| `{_cell(shown)}` | `{module}` | {seam.kind} | "
                     f"{_cell(seam.why)} | {_cell(seam.remove_when)} | "
                     f"{wire} |")
    return "\n".join(lines) + "\n"


def record_json(version: str) -> str:
    """The record of the installed vLLM, as `records/<version>.json`.

    Args:
        version: The installed vLLM's version.

    Returns:
        The JSON text: each seam's member with the fields `current` sets
        (`recorded_on` says what was installed; say more by hand).
    """
    members = {}
    for seam in SEAMS:
        expect = current(seam)
        members[seam.member] = {
            field.name: list(value) if field.name == "defines" else value
            for field in dataclasses.fields(expect)
            if (value := getattr(expect, field.name)) not in (None, False)
        }
    return json.dumps(
        {
            "vllm": version,
            "recorded_on": f"vLLM {version} as installed",
            "members": members
        },
        indent=1) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    import vllm
    command = ((argv if argv is not None else sys.argv[1:]) or ["check"])[0]
    if command == "markdown":
        print(markdown(), end="")
    elif command == "record":
        print(record_json(vllm.__version__), end="")
    else:
        version = supported_version(vllm.__version__)
        if version is None:
            version = SUPPORTED_VLLM_VERSIONS[-1]
            print(f"vLLM {vllm.__version__} is not supported; compared "
                  f"with {version}'s record")
        from vllm_sequence_hooks.releases import VENDORED
        problems = [p for seam in SEAMS for p in check(seam, version)]
        problems += [p for v in VENDORED for p in check_vendored(v, version)]
        print("\n".join(problems) or f"every seam as in vLLM {version}")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
