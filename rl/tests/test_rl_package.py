# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The trainer's own distribution (`vllm-sequence-hooks-rl`, rl/): its
wheel, built as from a fresh clone, holds the trainer's package alone and
requires the plugin and TRL (the plugin's wheel holds neither:
v1/tests/test_v1_wheel.py)."""

import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "vllm_sequence_hooks_rl"


def test_the_trainers_wheel_holds_its_package_and_needs_the_plugin(tmp_path):
    tracked = subprocess.run(["git", "ls-files", "rl"],
                             capture_output=True,
                             text=True,
                             check=True,
                             cwd=ROOT).stdout.split()
    for name in tracked:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    subprocess.run([
        sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
        str(tmp_path / "wheels"),
        str(tmp_path / "rl")
    ],
                   check=True,
                   timeout=600)
    [wheel] = (tmp_path / "wheels").glob(f"{PACKAGE}-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        [metadata] = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = Parser().parsestr(
            archive.read(metadata).decode()).get_all("Requires-Dist")
    modules = {n for n in names if ".dist-info/" not in n}
    assert modules == {
        name.removeprefix("rl/")
        for name in tracked if name.startswith(f"rl/{PACKAGE}/")
    }
    assert {re.match(r"[\w.-]+", r)[0]
            for r in requires} == {"vllm-sequence-hooks", "trl"}
