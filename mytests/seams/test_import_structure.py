# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The import structure of our own code: layered, without cycles, and
nothing imported by path.

Parses (never imports) every module of ours: the fork's modules (`vllm/`,
at their upstream paths), the engine-neutral package (`common/`), the V1
plugin (`v1/vllm_sequence_hooks`), the GRPO trainer over it
(`rl/vllm_sequence_hooks_rl`), the test kit (`testkit/`), the training
tasks (`training/`), the references (`references/`), the benchmark
clients (`benchmarks/clients/`) and the scripts that import each other by
name (`fork/`, `training/research/`, `rl/experiment/`, `benchmarks/v0/`,
`benchmarks/v1/`, `examples/`). Every import of one of them is an edge,
wherever it stands: at module level, under `if TYPE_CHECKING:` or inside a
function (an import deferred to dodge a cycle is still a cycle). Upstream
vLLM's modules are not nodes, so only imports between ours count.

The layers, from the ground up: the product (fork modules, `common/`, the
plugin), the trainer (its own distribution: serving never imports it),
the test kit, the training tasks (built on the kit's tiny tokenizer), the
references (the formats' controllers and the client-side join, built on
the kit's scripted models), the benchmark clients (built on the
references and the tasks), then the scripts (benchmarks, training,
examples). An import runs from a layer to one below it or within it,
never up.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Folder -> the package in it, whose files are modules named from there.
PACKAGES = {
    ROOT: "vllm",
    ROOT / "common": "sequence_hooks",
    ROOT / "v1": "vllm_sequence_hooks",
    ROOT / "rl": "vllm_sequence_hooks_rl",
    ROOT / "testkit": "sequence_hooks_testkit",
    ROOT / "training": "sequence_hooks_training",
    ROOT / "references": "sequence_hooks_references",
    ROOT / "benchmarks" / "clients": "sequence_hooks_bench",
}
# Folders of scripts that import each other as top-level modules.
SCRIPT_FOLDERS = (ROOT / "fork", ROOT / "training" / "research",
                  ROOT / "rl" / "experiment", ROOT / "benchmarks" / "v0",
                  ROOT / "benchmarks" / "v1", ROOT / "examples")
# The layers below the scripts, from the ground up.
LAYERS = (("vllm", "sequence_hooks",
           "vllm_sequence_hooks"), ("vllm_sequence_hooks_rl", ),
          ("sequence_hooks_testkit", ), ("sequence_hooks_training", ),
          ("sequence_hooks_references", ), ("sequence_hooks_bench", ))


def our_modules() -> dict[str, Path]:
    """Module name -> file, for every module of ours."""
    modules = {}
    for folder, package in PACKAGES.items():
        for path in sorted((folder / package).rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    for folder in SCRIPT_FOLDERS:
        for path in sorted(folder.glob("*.py")):
            modules[path.stem] = path
    return modules


def imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that ``module``'s file imports, anywhere in it."""

    def ours(name: str) -> str | None:
        """``name`` or its longest prefix that is one of ours."""
        parts = name.split(".")
        while parts:
            if ".".join(parts) in modules:
                return ".".join(parts)
            parts.pop()
        return None

    package = module.split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {ours(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[:len(package) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(ours(f"{base}.{alias.name}") or ours(base))
    return found - {None, module}


def import_graph() -> dict[str, set[str]]:
    modules = our_modules()
    return {
        module: imported(module, path, modules)
        for module, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan),
    each as one cycle through all of it, in import order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [cycle_through(graph, set(c)) for c in components]


def cycle_through(graph: dict[str, set[str]], component: set[str]) -> list:
    """A path from the component's first module back to it, within it."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for other in sorted(graph[node] & component):
            if other == start:
                return paths[node] + [start]
            if other not in paths:
                paths[other] = paths[node] + [other]
                frontier.append(other)
    raise AssertionError(f"no cycle through {start}")


def test_the_graph_covers_every_root():
    graph = import_graph()
    for package in PACKAGES.values():
        assert any(m.split(".")[0] == package for m in graph), package
    scripts = {
        "build_fork", "eval_real_model", "rl_capitals", "http_peers", "demo"
    }
    assert scripts <= set(graph)
    assert ("sequence_hooks_training.capitals_task"
            in graph["eval_by_country"])
    assert ("sequence_hooks_bench.http_sides" in graph["profile_peers"])
    assert ("sequence_hooks_references.client_join"
            in graph["sequence_hooks_bench.http_sides"])
    assert ("sequence_hooks_testkit.formats.threadweaver_format"
            in graph["sequence_hooks_training.threadweaver_task"])


def test_imports_of_every_kind_are_edges(tmp_path):
    source = tmp_path / "__init__.py"
    source.write_text("""
from typing import TYPE_CHECKING
import a.b.c
from a import d
from . import e
from .f import name
if TYPE_CHECKING:
    from a.g import Name
def later():
    from a.h import name
""")
    edges = {"a.b", "a.d", "a.e", "a.f", "a.g", "a.h"}
    assert imported("a", source, dict.fromkeys(edges | {"a"})) == edges


def test_no_import_cycle_among_our_modules():
    found = cycles(import_graph())
    message = "\n".join(" -> ".join(cycle) for cycle in found)
    assert not found, f"import cycles:\n{message}"


def layer(module: str) -> int:
    """0 for the product, 1 for the trainer, 2 for the test kit, 3 for
    the training tasks, 4 for the references, 5 for the benchmark
    clients, 6 for the scripts."""
    package = module.split(".")[0]
    return next(
        (level
         for level, packages in enumerate(LAYERS) if package in packages),
        len(LAYERS))


def test_imports_never_run_up_a_layer():
    upward = sorted(f"{module} -> {other}"
                    for module, imports in import_graph().items()
                    for other in imports if layer(other) > layer(module))
    assert not upward, "imports from a lower layer to a higher one:\n" + (
        "\n".join(upward))


def path_edits(path: Path) -> list[int]:
    """The lines of ``path`` that reach ``sys.path``."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Attribute) and node.attr == "path"
        and isinstance(node.value, ast.Name) and node.value.id == "sys"
    ]


def test_nothing_is_imported_by_path(tmp_path):
    """Only test configuration (a conftest, pyproject's `pythonpath`)
    extends the import path: the code imports what is installed."""
    edit = tmp_path / "script.py"
    edit.write_text("import sys\nsys.path.insert(0, 'x')\n")
    assert path_edits(edit) == [2]
    folders = [*SCRIPT_FOLDERS, *(f / p for f, p in PACKAGES.items())]
    files = [ROOT / "setup.py"] + [
        path for folder in folders
        for path in folder.rglob("*.py") if path.name != "conftest.py"
    ]
    edits = [
        f"{path.relative_to(ROOT)}:{line}" for path in files
        for line in path_edits(path)
    ]
    assert not edits, f"sys.path edited outside test configuration: {edits}"
