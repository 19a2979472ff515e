# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the RL suite: TRL 1.16 and the plugin on vLLM 0.31, in
`.venv-rl` (`./dev test-rl`).

The model is the real promise model (SmolLM2-135M, fp32), the smallest
that writes promise trees of its own: `./dev setup` prepares it.
"""

import os
from pathlib import Path

import pytest

# Before vLLM is imported: no hub access, a small KV cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture(scope="session")
def real_model() -> Path:
    from sequence_hooks_training import prepare_base_model as prepare
    path = prepare.model_dir()
    if not (path / prepare.DONE).exists():
        pytest.fail(f"{path} is not prepared: run ./dev setup first "
                    "(./dev test-rl does)")
    return path
