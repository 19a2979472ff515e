# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The project's per-user cache, where downloads, the prepared models,
upstream's test sources and built wheels are kept between runs.

`fork/build_fork.py` and `v1/vllm-cpu-overlay/build.py` name the same
folder themselves: they run before any venv holds the test kit.
"""

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache folder (made if missing): `$XDG_CACHE_HOME/vllm-seqhook`,
    by default under `~/.cache`.

    Returns:
        Its path.
    """
    base = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    path = Path(base) / "vllm-seqhook"
    path.mkdir(parents=True, exist_ok=True)
    return path
