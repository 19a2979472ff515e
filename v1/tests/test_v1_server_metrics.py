# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The hooks' metrics on a plain hooked server: `vllm serve MODEL
--special-kwargs ...`, one API server, started from an environment with
no `PROMETHEUS_MULTIPROC_DIR`. The flag turns prometheus' multiprocess
mode on (`server_metrics`) in a private folder, removed at exit, so every
`vllm:sequence_hook_*` metric, updated in the engine core's process,
shows on `/metrics` while a tree is live and once it is done, beside
vLLM's own metrics of the API process. (A folder the user sets is kept
to: test_v1_serving.py.)"""

import argparse
import os
import re
import threading
from pathlib import Path

import prometheus_client.values
import pytest
import requests
from vllm_sequence_hooks.config import CONFIG_KEY
from vllm_sequence_hooks.engine_args import is_hooked_server
from vllm_sequence_hooks.server_metrics import ENV, show_engine_core_metrics

from sequence_hooks_testkit.server import stop_server
from sequence_hooks_testkit.shutdown_check import wait_until
from sequence_hooks_testkit.v1_server import (REQUEST_TIMEOUT_S, metric_totals,
                                              scripted_body,
                                              start_hooked_v1_server)

PREFIX = "vllm:sequence_hook_"
HOOK_METRICS = ("promises_spawned_total", "promises_refused_total",
                "syncs_blocked_total", "merged_tokens_total",
                "blocked_time_seconds_count", "blocked_time_seconds_sum",
                "parents_parked", "children_running", "kv_cache_usage_perc")
# Of the API process itself, fed by the engine core's stats.
VLLM_OWN = ("vllm:num_requests_running", "vllm:generation_tokens_total")
# The child writes this many tokens, an engine step each, each step slowed
# by STEP_DELAY_S: its parent stays parked for seconds.
CHILD_TOKENS = 150
STEP_DELAY_S = 0.05
LIVE_TIMEOUT_S = 60
# The counters of one tree of one promise and one sync, within limits.
ONE_TREE = {
    "promises_spawned_total": 1,
    "promises_refused_total": 0,
    "syncs_blocked_total": 1
}


def read_metrics(url: str) -> dict[str, float]:
    """Every hook metric (by its name after `vllm:sequence_hook_`), each
    of which must be there, and those of `VLLM_OWN` that are (a gauge
    shows once it is set), from one read of /metrics."""
    text = requests.get(url + "/metrics", timeout=REQUEST_TIMEOUT_S).text
    hooks = [PREFIX + name for name in HOOK_METRICS]
    shown = {
        line.split("{", 1)[0].split(" ", 1)[0]
        for line in text.splitlines() if not line.startswith("#")
    }
    assert not set(hooks) - shown, sorted(set(hooks) - shown)
    totals = metric_totals(text, hooks + list(VLLM_OWN), VLLM_OWN)
    return {
        name.removeprefix(PREFIX): value
        for name, value in totals.items() if name in shown
    }


def read_when(url: str, name: str, value: float,
              expected: dict[str, float]) -> dict[str, float]:
    """Reads the metrics (`read_metrics`) until ``name`` is ``value``
    (failing after `LIVE_TIMEOUT_S`), checks that read against
    `ONE_TREE` and ``expected`` and returns it."""
    read: dict[str, float] = {}

    def check() -> bool:
        read.clear()
        read.update(read_metrics(url))
        return read[name] == value

    wait_until(check, LIVE_TIMEOUT_S, f"{name} never {value}")
    assert read == {**read, **ONE_TREE, **expected}
    return read


def metrics_folder(log: Path) -> Path:
    """The folder the plugin made, as the server's log names it."""
    [folder] = re.findall(r"prometheus multiprocess mode, in (\S+) ",
                          log.read_text())
    return Path(folder)


def test_every_hook_metric_shows_live_and_at_rest(tiny_model_path, hook_ids,
                                                  tmp_path):
    process, url = start_hooked_v1_server(tiny_model_path,
                                          tmp_path,
                                          step_delay_s=STEP_DELAY_S)
    try:
        folder = metrics_folder(tmp_path / "server.log")
        assert folder.is_dir()
        P, S = hook_ids.promise, hook_ids.sync
        plans = {(): [None, P, S, None], (0, ): [None] * CHILD_TOKENS}
        answers = []
        request = threading.Thread(target=lambda: answers.append(
            requests.post(url + "/v1/completions",
                          json=scripted_body(plans,
                                             hook_ids,
                                             tiny_model_path,
                                             False,
                                             max_tokens=CHILD_TOKENS + 40),
                          timeout=REQUEST_TIMEOUT_S)))
        request.start()
        # Live: the parent parked at its `<sync>`, its child writing.
        live = read_when(
            url, "parents_parked", 1, {
                "merged_tokens_total": 0,
                "blocked_time_seconds_count": 0,
                "blocked_time_seconds_sum": 0,
                "children_running": 1
            })
        assert live["kv_cache_usage_perc"] > 0
        # vLLM's own metrics of the API process show beside the hooks'.
        assert set(VLLM_OWN) <= set(live)
        assert list(folder.glob("*.db"))
        request.join(REQUEST_TIMEOUT_S)
        [answer] = answers
        assert answer.status_code == 200, answer.text
        tree = answer.json()["kv_transfer_params"]["promise_tree"]
        assert len(tree["children"][0]["token_ids"]) == CHILD_TOKENS + 1
        # At rest: the tree done, its merge and its parked time counted,
        # its blocks free once the engine core has stepped past its end.
        rest = read_when(
            url, "kv_cache_usage_perc", 0, {
                "merged_tokens_total": tree["num_merged_tokens"],
                "blocked_time_seconds_count": 1,
                "parents_parked": 0,
                "children_running": 0
            })
        assert rest["blocked_time_seconds_sum"] > 0
        assert rest["vllm:generation_tokens_total"] > 0
    finally:
        stop_server(process)
    assert process.returncode == 0
    assert not folder.exists()


@pytest.mark.parametrize("args, hooked", [
    ({}, True),
    ({
        "headless": True
    }, False),
    ({
        "additional_config": {}
    }, False),
],
                         ids=["server", "headless", "no-hooks"])
def test_only_a_hooked_api_server_turns_the_mode_on(args, hooked):
    """A server's parsed arguments (`middleware` is a server's flag) with
    hooks; a headless engine host has no `/metrics`."""
    parsed = argparse.Namespace(
        **{
            "middleware": [],
            "headless": False,
            "additional_config": {
                CONFIG_KEY: {}
            },
            **args
        })
    assert is_hooked_server(parsed) is hooked
    del parsed.middleware
    assert not is_hooked_server(parsed)


def test_a_folder_the_user_set_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))
    value_class = prometheus_client.values.ValueClass
    show_engine_core_metrics()
    assert os.environ[ENV] == str(tmp_path)
    assert prometheus_client.values.ValueClass is value_class
    assert not list(tmp_path.iterdir())


def test_a_metric_missing_from_metrics_is_an_error_not_zero():
    """An idle or leak check that read a missing metric as 0 would pass
    whatever the server holds: `metric_totals` names it instead."""
    text = ("# HELP vllm:a_total A.\nvllm:a_total{engine=\"0\"} 2.0\n"
            "vllm:a_total{engine=\"1\"} 1.0\n")
    assert metric_totals(text, ["vllm:a_total"]) == {"vllm:a_total": 3.0}
    with pytest.raises(KeyError, match="vllm:b"):
        metric_totals(text, ["vllm:a_total", "vllm:b"])
    assert metric_totals(text, ["vllm:b"], ["vllm:b"]) == {"vllm:b": 0.0}
