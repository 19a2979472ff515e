# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The real model's cache: a changed delta's old merge is removed.

Each merge is a full checkpoint (517 MB); without this, every version of
the delta a checkout ever set up stayed in the cache.
"""

from sequence_hooks_training import prepare_base_model as prepare


def make_delta(folder, weights: bytes):
    """A delta folder whose digest changes with ``weights``."""
    folder.mkdir(exist_ok=True)
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def test_only_merges_of_other_versions_of_the_delta_go(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    delta = make_delta(tmp_path / "smollm2-promise", b"old")
    old = prepare.model_dir(delta)
    delta = make_delta(delta, b"new")
    new = prepare.model_dir(delta)
    assert old.parent == new.parent and old != new
    other_delta = prepare.model_dir(make_delta(tmp_path / "runC", b"x"))
    base = new.parent / prepare.BASE_NAME
    longer_name = new.parent / f"smollm2-promise-extra-{'0' * 12}"
    for folder in (old, new, other_delta, base, longer_name):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"weights")

    prepare.remove_stale_merges(new)

    assert not old.exists()
    assert all(f.exists() for f in (new, other_delta, base, longer_name))
