# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every upstream vLLM member the plugin overrides or reaches, and the vLLM
versions it was tested on.

The plugin patches no vLLM file, but it subclasses V1's scheduler, calls
private scheduler methods, writes request fields, builds engine-core
requests and outputs and relies on how the frontend fans out samples and
carries `kv_transfer_params`. `SEAMS` lists each such member once, with
why it is reached and when the reach can go, in four tables by where
the reach is: the scheduler's (`seams_scheduler`), outside the engine
core (`seams_frontend`), the configuration's (`seams_config`) and a
join's that splices KV (`seams_runner`: worker, model runner, blocks). One
record per supported vLLM version (`records/<version>.json`, data) holds
what that version has of each: its signature, and for overridden
methods, private methods we call and code whose behaviour we rely on, the
sha256 of its source (`seams_types` has the row's and the entry's
fields). The tripwires (`tripwires`, run by v1/tests/test_v1_seams.py),
docs/seams.md (rendered from `SEAMS`) and the version check below all
read these facts, so they cannot disagree.

`check_vllm_version` refuses a vLLM without a record: a version nobody
checked these members on.
"""

from typing import Optional

from vllm_sequence_hooks.seams_config import CONFIG_SEAMS
from vllm_sequence_hooks.seams_frontend import FRONTEND_SEAMS
from vllm_sequence_hooks.seams_runner import RUNNER_SEAMS
from vllm_sequence_hooks.seams_scheduler import SCHEDULER_SEAMS
from vllm_sequence_hooks.seams_types import Seam

# vLLM releases the plugin was tested on, each with its record
# (`records/0.32.0.json` for 0.32.0), oldest first.
SUPPORTED_VLLM_VERSIONS = ("0.31.0", "0.32.0", "0.33.0")

SEAMS: tuple[Seam, ...] = (SCHEDULER_SEAMS + FRONTEND_SEAMS + CONFIG_SEAMS +
                           RUNNER_SEAMS)


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is not one the plugin was tested on."""


def supported_version(version: str) -> Optional[str]:
    """The supported release ``version`` is a build of, or None.

    A local version label (`+cpu`, `+cu129`) names a build of the same
    source and is ignored; a pre-, post- or dev release is another one.
    """
    public = version.split("+", 1)[0]
    return public if public in SUPPORTED_VLLM_VERSIONS else None


def check_vllm_version(version: Optional[str] = None) -> str:
    """Refuses a vLLM the plugin was not tested on.

    Args:
        version: The version to check; the imported vLLM's by default.

    Returns:
        The supported release it is.

    Raises:
        UnsupportedVllmVersion: if no record of its seams exists.
    """
    if version is None:
        import vllm
        version = vllm.__version__
    supported = supported_version(version)
    if supported is None:
        raise UnsupportedVllmVersion(
            f"vllm-sequence-hooks supports vLLM "
            f"{', '.join(SUPPORTED_VLLM_VERSIONS)}, not the installed "
            f"{version}: it reaches into vLLM's scheduler, requests and "
            f"outputs (docs/seams.md), and was not tested on {version}. "
            f"Install a supported vLLM.")
    return supported
