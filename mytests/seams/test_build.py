# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The build refuses patches that do not apply exactly, naming them."""

from pathlib import Path

import build_fork
import pytest

UPSTREAM_FILE = "vllm/engine/output_processor/interfaces.py"


def make_patch(tmp_path: Path, name: str, context_line: int) -> Path:
    """Writes a one-line patch whose hunk claims ``context_line``."""
    source = (build_fork.pristine_tree("cpu") /
              UPSTREAM_FILE).read_text().splitlines()
    patch = tmp_path / name
    # One line of context on each side: the hunk's real place is line 1.
    patch.write_text(f"--- a/{UPSTREAM_FILE}\n+++ b/{UPSTREAM_FILE}\n"
                     f"@@ -{context_line},2 +{context_line},3 @@\n"
                     f" {source[0]}\n+# added\n {source[1]}\n")
    (tmp_path / "series").write_text(f"# test series\n{name}\n")
    return patch


@pytest.fixture
def scratch_tree(tmp_path):
    tree = tmp_path / "tree"
    (tree / Path(UPSTREAM_FILE).parent).mkdir(parents=True)
    (tree / UPSTREAM_FILE).write_text(
        (build_fork.pristine_tree("cpu") / UPSTREAM_FILE).read_text())
    return tree


def test_the_series_applies_to_pristine_upstream():
    assert build_fork.main(["--check-patches"]) == 0


def test_exact_patch_applies(tmp_path, scratch_tree, monkeypatch):
    monkeypatch.setattr(build_fork, "PATCHES", tmp_path)
    make_patch(tmp_path, "exact.patch", context_line=1)
    build_fork.apply_patches(scratch_tree)
    assert "# added" in (scratch_tree / UPSTREAM_FILE).read_text()


def test_patch_that_needs_an_offset_is_refused_by_name(tmp_path, scratch_tree,
                                                       monkeypatch):
    monkeypatch.setattr(build_fork, "PATCHES", tmp_path)
    make_patch(tmp_path, "moved.patch", context_line=5)
    with pytest.raises(build_fork.BuildError, match="moved.patch"):
        build_fork.apply_patches(scratch_tree)


def test_module_replacing_an_upstream_file_is_refused(tmp_path, monkeypatch):
    ours = tmp_path / "ours"
    (ours / "engine").mkdir(parents=True)
    (ours / "engine" / "llm_engine.py").write_text("# not ours to replace\n")
    package = tmp_path / "package"
    (package / "engine").mkdir(parents=True)
    (package / "engine" / "llm_engine.py").write_text("# upstream\n")
    monkeypatch.setattr(build_fork, "OUR_MODULES", ours)
    with pytest.raises(build_fork.BuildError, match="llm_engine.py"):
        build_fork.add_our_modules(package)
