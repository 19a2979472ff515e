# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Assemble the fork: pinned upstream vLLM + ``patches/`` + our ``vllm/``.

The result is a package tree in ``build/tree-<target>/vllm`` (plus the
engine-neutral package ``common/sequence_hooks`` beside it) that
``setup.py`` turns into a distribution named ``vllm``:

* ``cpu``: the Python tree of the upstream sdist, with ``_C`` compiled here
  from the sdist's ``csrc/cpu`` (cached, keyed by upstream version, compiler,
  Python and torch, so a second build does not recompile);
* ``cuda``: the official wheel, whose compiled kernels are kept as they are.

Then every patch in ``patches/series`` is applied with zero fuzz (the build
fails naming the patch otherwise): first ``patches/hardening/`` (fixes of
upstream bugs, each also applying to pristine upstream on its own), then
``patches/features/`` (the seams of the sequence hooks). Our modules are
added as symlinks, so in an editable install an edit takes effect without
rebuilding (a wheel build copies their contents).

Usage::

    python fork/build_fork.py [--target cpu|cuda]
    python fork/build_fork.py --check-patches
    python fork/build_fork.py --fetch PROJECT FILENAME SHA256  # prints it
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"
PATCHES = ROOT / "patches"
OUR_MODULES = ROOT / "vllm"
# Engine-neutral package shared with the V1 plugin, shipped beside vllm.
NEUTRAL_PACKAGE = ROOT / "common" / "sequence_hooks"

UPSTREAM_VERSION = "0.9.2"
# The one local-version label; platform detection looks for "cpu" in it.
LOCAL_LABEL = "seqhook"
# Pinned upstream artifacts: file name and sha256, per build target.
UPSTREAM_ARTIFACTS = {
    "cpu":
    ("vllm-0.9.2.tar.gz",
     "6b0d855ea8ba18d76364c9b82ea94bfcaa9c9e724055438b5733e4716ed104e1"),
    "cuda":
    ("vllm-0.9.2-cp38-abi3-manylinux1_x86_64.whl",
     "f3c5da29a286f4933b480a5b4749fab226564f35c96928eeef547f88d385cd34"),
}
# The CUDA toolkit that PyPI torch's CMake config insists on finding, even
# for a CPU-only extension (see docs/build.md); the image has one here.
CUDA_HOME = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))


class BuildError(RuntimeError):
    """A build step failed; the message says which and why."""


def cache_dir() -> Path:
    """Returns the per-user cache for downloads and compiled ``_C``."""
    base = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    path = Path(base) / "vllm-seqhook"
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def index_url() -> str:
    """The package index downloads are resolved through: the
    ``VLLM_SEQHOOK_INDEX_URL`` environment variable, else the one pip is
    configured with, else pip's default."""
    chosen = os.environ.get("VLLM_SEQHOOK_INDEX_URL")
    if chosen:
        return chosen.rstrip("/")
    configured = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
        capture_output=True,
        text=True).stdout.strip()
    if configured:
        return configured.rstrip("/")
    from pip._internal.models.index import PyPI
    return PyPI.simple_url.rstrip("/")


def fetch_pinned(project: str, filename: str, sha256: str) -> Path:
    """Downloads a file of the package index once into the cache and checks
    it against its pinned sha256: the project's one download helper (the
    overlay build and the test kit run it as ``--fetch``).

    ``pip download`` cannot fetch an sdist of vLLM (it builds its metadata,
    which needs torch), so the file is resolved through the index's simple
    API, JSON form.

    Args:
        project: The project's name on the index.
        filename: The file.
        sha256: Its pinned sha256.

    Returns:
        Its path in the cache.

    Raises:
        BuildError: if the index cannot be reached, does not list the file
            or serves other bytes than the pinned ones.
    """
    path = cache_dir() / "downloads" / filename
    if path.exists() and sha256_of(path) == sha256:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".part")
    index = index_url()
    request = urllib.request.Request(
        f"{index}/{project}/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            files = json.load(response)["files"]
        urls = [f["url"] for f in files if f["filename"] == filename]
        if not urls:
            raise BuildError(f"{filename} is not on {index}")
        print(f"downloading {filename}", file=sys.stderr, flush=True)
        with urllib.request.urlopen(urls[0], timeout=600) as response, \
                partial.open("wb") as f:
            shutil.copyfileobj(response, f)
    except (OSError, ValueError, KeyError) as e:
        raise BuildError(f"cannot fetch {filename} from {index}: {e}") from e
    if sha256_of(partial) != sha256:
        partial.unlink()
        raise BuildError(f"{filename}: sha256 differs from the pinned one")
    partial.rename(path)
    return path


def pristine_tree(target: str) -> Path:
    """Returns the unpacked upstream source (sdist) or wheel, untouched."""
    archive = fetch_pinned("vllm", *UPSTREAM_ARTIFACTS[target])
    dest = BUILD / "upstream" / target
    stamp = dest / ".sha256"
    if stamp.exists() and stamp.read_text() == UPSTREAM_ARTIFACTS[target][1]:
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    if target == "cpu":
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
        # The sdist unpacks into vllm-<version>/; flatten it.
        inner = dest / f"vllm-{UPSTREAM_VERSION}"
        for child in inner.iterdir():
            child.rename(dest / child.name)
        inner.rmdir()
    else:
        with zipfile.ZipFile(archive) as wheel:
            wheel.extractall(dest)
    stamp.write_text(UPSTREAM_ARTIFACTS[target][1])
    return dest


def compiler_id() -> str:
    out = subprocess.run(["c++", "--version"],
                         capture_output=True,
                         text=True,
                         check=True).stdout
    return out.splitlines()[0]


def compiled_c_extension(source: Path) -> Path:
    """Returns ``_C.abi3.so`` built from the sdist's ``csrc/cpu``, cached.

    vLLM's own setup.py does not forward CMake arguments, so CMake is
    configured directly, with the two CUDA hints PyPI torch needs.
    """
    import torch
    key_text = "|".join([
        UPSTREAM_ARTIFACTS["cpu"][1],
        compiler_id(), torch.__version__,
        sys.version.split()[0], "avx2"
    ])
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    cached = cache_dir() / "_C" / key / "_C.abi3.so"
    if cached.exists():
        return cached
    nvrtc = (Path(torch.__file__).parent.parent / "nvidia" / "cuda_nvrtc" /
             "lib" / "libnvrtc.so.12")
    cmake_dir = BUILD / "cmake-cpu"
    shutil.rmtree(cmake_dir, ignore_errors=True)
    configure = [
        "cmake", "-S",
        str(source), "-B",
        str(cmake_dir), "-G", "Ninja", "-DVLLM_TARGET_DEVICE=cpu",
        f"-DVLLM_PYTHON_EXECUTABLE={sys.executable}",
        "-DCMAKE_BUILD_TYPE=Release", f"-DCUDA_TOOLKIT_ROOT_DIR={CUDA_HOME}",
        f"-Dnvtx3_dir={CUDA_HOME / 'include'}", f"-DCUDA_nvrtc_LIBRARY={nvrtc}"
    ]
    # CMake >= 3.26 and ninja come from the virtual environment. The AVX2
    # path is built on every machine: it runs on AVX-512 ones too, and the
    # AVX-512 path would download oneDNN, which is not reachable here.
    env = dict(os.environ, VLLM_CPU_DISABLE_AVX512="true")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    print(f"compiling _C (cache key {key}; takes minutes once)", flush=True)
    for command in (configure,
                    ["cmake", "--build",
                     str(cmake_dir), "--target", "_C"]):
        if subprocess.run(command, env=env).returncode != 0:
            raise BuildError(f"compiling _C failed: {' '.join(command)}")
    built = next(cmake_dir.rglob("_C.abi3.so"), None)
    if built is None:
        raise BuildError(f"no _C.abi3.so under {cmake_dir}")
    cached.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, cached)
    return cached


def series() -> list[Path]:
    """The patches, in the order ``patches/series`` lists them (paths
    relative to ``patches/``, e.g. ``hardening/0001-....patch``)."""
    names = [
        line.split("#")[0].strip()
        for line in (PATCHES / "series").read_text().splitlines()
    ]
    return [PATCHES / name for name in names if name]


def apply_patch(tree: Path, patch: Path, dry_run: bool = False) -> None:
    """Applies one patch to ``tree`` with zero fuzz, or fails naming it."""
    command = [
        "patch", "-p1", "--fuzz=0", "--forward", "--batch",
        "--no-backup-if-mismatch", "-d",
        str(tree), "-i",
        str(patch)
    ] + (["--dry-run"] if dry_run else [])
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0 or "offset" in result.stdout:
        raise BuildError(f"patch {patch.relative_to(PATCHES)} does not apply "
                         f"cleanly to upstream {UPSTREAM_VERSION}:\n"
                         f"{result.stdout}{result.stderr}")


def apply_patches(tree: Path) -> None:
    """Applies the series to ``tree`` with zero fuzz, or fails naming the
    first patch that does not apply."""
    for patch in series():
        apply_patch(tree, patch)


def check_hardening_alone(pristine: Path) -> None:
    """Each hardening patch applies to pristine upstream by itself: it is
    the diff that would be proposed upstream, needing no other patch."""
    for patch in series():
        if patch.parent.name == "hardening":
            apply_patch(pristine, patch, dry_run=True)


def tree_for(target: str) -> Path:
    """The assembled tree of ``target``; ``setup.py`` packages it."""
    return BUILD / f"tree-{target}"


def our_files(folder: Path) -> list[Path]:
    """The files of one of our source folders, caches left out."""
    return [
        path for path in sorted(folder.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    ]


def add_our_modules(package: Path) -> None:
    """Adds every file of our ``vllm/`` to the assembled package, and the
    engine-neutral package beside it.

    Upstream files are never replaced wholesale: a change to one is a patch.
    """
    for folder, dest_folder in ((OUR_MODULES, package),
                                (NEUTRAL_PACKAGE,
                                 package.parent / NEUTRAL_PACKAGE.name)):
        for ours in our_files(folder):
            dest = dest_folder / ours.relative_to(folder)
            if dest.exists() or dest.is_symlink():
                raise BuildError(
                    f"{folder.name}/{ours.relative_to(folder)} would replace "
                    "an upstream file; change it with a patch instead")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.symlink_to(ours)


def version_for(target: str) -> str:
    device = "cpu" if target == "cpu" else "cu128"
    return f"{UPSTREAM_VERSION}+{LOCAL_LABEL}.{device}"


def inputs_digest(target: str) -> str:
    """Hashes what the assembled tree depends on besides upstream itself.

    Our modules count by name only: they are symlinked, so an edit to one
    needs no rebuild, but a new or removed one does.
    """
    digest = hashlib.sha256(f"{target}|{version_for(target)}".encode())
    for path in sorted(PATCHES.rglob("*")) + [Path(__file__)]:
        if path.is_file():
            digest.update(
                str(path.relative_to(ROOT)).encode() + path.read_bytes())
    for folder in (OUR_MODULES, NEUTRAL_PACKAGE):
        for ours in sorted(folder.rglob("*.py")):
            digest.update(str(ours.relative_to(ROOT)).encode())
    return digest.hexdigest()


def is_fresh(target: str) -> bool:
    """Whether ``tree_for(target)`` was assembled from the current inputs."""
    info = tree_for(target) / "BUILD_INFO.json"
    return (info.exists() and json.loads(info.read_text()).get("inputs")
            == inputs_digest(target))


def assemble(target: str) -> str:
    """Builds ``tree_for(target)``; returns the version it carries."""
    pristine = pristine_tree(target)
    c_extension = compiled_c_extension(pristine) if target == "cpu" else None
    tree = tree_for(target)
    staging = tree.with_name(tree.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    shutil.copytree(pristine / "vllm",
                    staging / "vllm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    apply_patches(staging)
    package = staging / "vllm"
    add_our_modules(package)
    if c_extension is not None:
        shutil.copy2(c_extension, package / "_C.abi3.so")
    version = version_for(target)
    (package / "_version.py").write_text(
        "# Written by fork/build_fork.py.\n"
        f"__version__ = version = {version!r}\n"
        f"__version_tuple__ = version_tuple = {tuple(version.split('.'))!r}\n")
    (staging / "BUILD_INFO.json").write_text(
        json.dumps(
            {
                "target": target,
                "version": version,
                "inputs": inputs_digest(target),
            },
            indent=2))
    # Swap in one step so a failed build leaves the previous tree working.
    shutil.rmtree(tree, ignore_errors=True)
    staging.rename(tree)
    return version


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=["cpu", "cuda"], default="cpu")
    for switch, meaning in (
        ("--check-patches", "only check that the series applies with zero "
         "fuzz to pristine upstream"),
        ("--if-stale", "do nothing if the tree is up to date"),
    ):
        parser.add_argument(switch, action="store_true", help=meaning)
    parser.add_argument("--fetch",
                        nargs=3,
                        metavar=("PROJECT", "FILENAME", "SHA256"),
                        help="only download a pinned file of the package "
                        "index into the cache (once) and print its path")
    args = parser.parse_args(argv)
    if args.if_stale and is_fresh(args.target):
        return 0
    try:
        if args.fetch:
            print(fetch_pinned(*args.fetch))
            return 0
        if args.check_patches:
            scratch = BUILD / "patch-check"
            shutil.rmtree(scratch, ignore_errors=True)
            shutil.copytree(pristine_tree(args.target) / "vllm",
                            scratch / "vllm",
                            ignore=shutil.ignore_patterns("__pycache__"))
            apply_patches(scratch)
            shutil.rmtree(scratch)
            check_hardening_alone(pristine_tree(args.target))
            print(f"{len(series())} patches apply with zero fuzz, each "
                  "hardening patch also on its own")
            return 0
        version = assemble(args.target)
    except BuildError as e:
        print(f"build_fork: {e}", file=sys.stderr)
        return 1
    print(f"assembled vllm {version} in "
          f"{tree_for(args.target).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
