# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Packages the assembled fork as the distribution ``vllm``.

``fork/build_fork.py`` puts pinned upstream vLLM, our patches and our
modules together in ``build/tree-<target>``; this file packages that tree.
The target comes from ``VLLM_TARGET_DEVICE`` (``cpu`` or ``cuda``), as with
upstream vLLM; the tree is assembled here if it is missing.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
TARGET = os.environ.get("VLLM_TARGET_DEVICE", "cpu")
TREE = f"build/tree-{TARGET}"
BUILD_INFO = ROOT / TREE / "BUILD_INFO.json"


def requirements(path: Path) -> list[str]:
    """Reads a requirements file, following ``-r`` includes."""
    found = []
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            found += requirements(path.parent / line[3:].strip())
        elif line:
            found.append(line)
    return found


if TARGET not in ("cpu", "cuda"):
    raise SystemExit(f"VLLM_TARGET_DEVICE={TARGET!r}: this fork builds for "
                     "'cpu' or 'cuda'")
if not BUILD_INFO.exists():
    # The build script stands alone (standard library only): run, not
    # imported, since fork/ is not a package.
    subprocess.run([
        sys.executable,
        str(ROOT / "fork" / "build_fork.py"), "--target", TARGET
    ],
                   check=True)
info = json.loads(BUILD_INFO.read_text())

setup(
    name="vllm",
    version=info["version"],
    description="vLLM 0.9.2 (V0 engine) with sequence hooks: <promise> "
    "spawns child sequences, <sync> joins them.",
    license="Apache-2.0",
    python_requires=">=3.9",
    package_dir={"": TREE},
    packages=find_packages(TREE),
    package_data={
        "vllm": [
            "py.typed", "*.so", "**/*.so", "**/*.json", "**/*.jinja",
            "**/*.jpg", "**/*.md", "**/README"
        ]
    },
    install_requires=requirements(ROOT / f"requirements-{TARGET}.txt"),
    entry_points={
        "console_scripts": ["vllm=vllm.entrypoints.cli.main:main"],
        "vllm.general_plugins": [
            "lora_filesystem_resolver = vllm.plugins.lora_resolvers."
            "filesystem_resolver:register_filesystem_resolver"
        ],
    },
)
