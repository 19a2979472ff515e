# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The hooks' metrics on a hooked `vllm serve`'s `/metrics`.

The hooks update their metrics (`sequence_hooks.metrics`) in the engine
core's process, and vLLM's API server shows another process's metrics
only in prometheus_client's multiprocess mode, which stock vLLM turns on
only for several API servers (`setup_multiprocess_prometheus` in
`run_multi_api_server`). With one API server the hooks' metrics would
never show, so a hooked server turns the mode on as vLLM does
(`show_engine_core_metrics`, which `engine_args` calls as `from_cli_args`
reads a server's arguments): a private temporary folder in
`PROMETHEUS_MULTIPROC_DIR`, inherited by the engine cores the server
starts and removed when the API process exits. A folder the user set is
used as it is.

prometheus_client reads that variable once, when it is imported, to pick
where metric values live (in the process, or in the folder's files), and
`vllm serve` imports it before it loads any plugin. So the choice is made
again here, before the API process creates any metric: every metric of
the server's processes then lives in the folder, as under several API
servers, and `/metrics` reads them all (`get_prometheus_registry`).
"""

import logging
import os
import tempfile
from typing import Optional

import prometheus_client.values

logger = logging.getLogger("vllm.sequence_hooks.server_metrics")

ENV = "PROMETHEUS_MULTIPROC_DIR"
# The folder this process made, removed when it is collected at exit. Not
# upstream's `setup_multiprocess_prometheus`: the API process's
# `AsyncLLM.shutdown` then hands its folder object, not a path, to
# prometheus_client (`shutdown_prometheus`, vLLM 0.32), which logs an
# error at every shutdown.
_folder: Optional[tempfile.TemporaryDirectory] = None


def show_engine_core_metrics() -> None:
    """Turns prometheus_client's multiprocess mode on for this API server
    process and the engine cores it starts, unless it is on already (the
    user's folder, or vLLM's for several API servers).

    Call it before the process creates a metric and before any engine core
    starts.
    """
    global _folder
    if ENV in os.environ:
        return
    _folder = tempfile.TemporaryDirectory(prefix="vllm-sequence-hooks-")
    os.environ[ENV] = _folder.name
    # What prometheus_client would have chosen had the variable been set
    # before it was imported.
    prometheus_client.values.ValueClass = (
        prometheus_client.values.get_value_class())
    logger.info(
        "Sequence hooks: the engine core's metrics reach /metrics through "
        "prometheus multiprocess mode, in %s (removed at exit)", _folder.name)
