# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Both sides of a format toy's cases, each run in a process of its own:
a reference controller's runner (`sequence_hooks_references.formats`)
and the in-engine one (`run_in_engine`)."""

import json
import subprocess
import sys
from pathlib import Path

# The two runners' packages: the controllers' (a client of stock vLLM)
# and the in-engine formats'.
REFERENCES = "sequence_hooks_references.formats."
TESTKIT = "sequence_hooks_testkit.formats."


def toy_prompts(model: Path) -> list[str]:
    """The prompts of a toy model's ``prompts.jsonl``, in order."""
    return [
        json.loads(line)["prompt"]
        for line in (model / "prompts.jsonl").read_text().splitlines()
    ]


def run(module: str, model: Path, args: list, cases: list,
        folder: Path) -> dict:
    """Runs the runner ``module`` on ``model`` with ``args`` and
    ``cases`` (written to ``folder``, where its output goes too).

    Returns:
        Its answered cases, by name.
    """
    (folder / "cases.json").write_text(json.dumps(cases))
    subprocess.run([
        sys.executable, "-m", module,
        str(model), *args, folder / "cases.json", folder / "out.json"
    ],
                   check=True,
                   timeout=1200)
    return {
        case["name"]: case
        for case in json.loads((folder / "out.json").read_text())
    }
