# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upstream vLLM's own async-scheduler tests against the plugin.

`tests/v1/core/test_async_scheduler.py` of the installed release's pinned
sdist (0.32.0 or 0.33.0, whose test lists are the same; fetched from the
package index, sha256 checked: no sdist, no pass) runs
as it is, in a pytest of its own, once per variant of the scheduler its
`create_scheduler` builds (`sequence_hooks_testkit.upstream_async_tests`):
stock `AsyncScheduler` as upstream configures it; the same with the
plugin's configuration (`stock-apc`, prefix caching on); the plugin's
class hooked on the tiny tokenizer's hook ids (`plugin`); and hooked on
ids no upstream test samples (`plugin-idle`). Every upstream test passes
on stock, and on the plugin too, but for the exceptions below, each
checked to fail for its reason:
- speculative decoding, which the plugin refuses at construction;
- two KV-pressure hand-off tests that need prefix caching off (their two
  requests share a prompt, so with it on the second one hits the first's
  blocks and nothing is preempted): `stock-apc` fails them the same way;
- `test_abort` with the hooks on the real hook ids: upstream's fake runner
  samples each request's index in the batch, so request 5 samples
  `<promise>`, later `<sync>`, and parks until it is aborted, with fewer
  tokens than one a step (the same test passes on `plugin-idle`).
"""

import json
import os
import subprocess
import sys

import pytest

from sequence_hooks_testkit import upstream_async_tests as upstream

# The upstream tests of the pinned sdist (ids without the variant).
UPSTREAM_TESTS = (
    "test_stop_by_max_tokens[1]",
    "test_stop_by_max_tokens[2]",
    "test_stop_by_max_tokens[3]",
    "test_stop_by_max_tokens[5]",
    "test_no_spec_decode_padding_up_to_max_model_len",
    "test_abort",
    "test_connector_metadata_precedes_async_placeholder_advance",
    "test_prefix_caching_for_prefill_dedup",
    "test_prefix_caching_for_multi_turn",
    "test_abort_request_when_structured_output_fsm_cannot_advance",
    "test_kv_pressure_preemption_with_inflight_output[0]",
    "test_kv_pressure_preemption_with_inflight_output[3]",
    "test_reset_prefix_cache_with_inflight_output_under_kv_pressure[1]",
    "test_reset_prefix_cache_with_inflight_output_under_kv_pressure[3]",
    "test_requires_kv_delivery_defaults_to_producer_role",
    "test_kv_pressure_preempt_mid_handoff[kv_producer-False]",
    "test_kv_pressure_preempt_mid_handoff[kv_consumer-False]",
    "test_kv_pressure_preempt_mid_handoff[kv_consumer-True]",
    "test_resumable_request_handoff",
)
# They configure speculative decoding (ngram drafts).
SPECULATIVE = (
    "test_no_spec_decode_padding_up_to_max_model_len",
    "test_kv_pressure_preemption_with_inflight_output[3]",
    "test_reset_prefix_cache_with_inflight_output_under_kv_pressure[1]",
    "test_reset_prefix_cache_with_inflight_output_under_kv_pressure[3]",
)
# They expect a preemption that a prefix-cache hit takes away.
NEED_NO_PREFIX_CACHING = (
    "test_kv_pressure_preempt_mid_handoff[kv_producer-False]",
    "test_kv_pressure_preempt_mid_handoff[kv_consumer-False]",
)
# They sample `<sync>` (4) or `<promise>` (5) under `plugin`.
SAMPLE_HOOK_IDS = ("test_abort", "test_prefix_caching_for_multi_turn")


def expected_failure(test: str, variant: str):
    """What ``test`` fails with on ``variant`` (a substring of its last
    line; "" for the hooks acting), None if it passes."""
    if variant.startswith("plugin") and test in SPECULATIVE:
        return "sequence hooks do not support speculative decoding"
    if variant != "stock" and test in NEED_NO_PREFIX_CACHING:
        return "RequestStatus.PREEMPTED"
    if variant == "plugin" and test == "test_abort":
        return ""
    return None


def node_id(test: str, variant: str) -> str:
    """The upstream node id of ``test`` on ``variant`` (the variant is the
    first parameter)."""
    name, _, params = test.partition("[")
    params = f"-{params[:-1]}" if params else ""
    return f"{upstream.TEST_FILE}::{name}[{variant}{params}]"


@pytest.fixture(scope="module")
def outcomes(tiny_model_path, tmp_path_factory) -> dict:
    """Each upstream test's outcome on each variant, by node id."""
    # Fails every test here if the sdist cannot be had: no silent skip.
    root = upstream.unpack_tests()
    work = tmp_path_factory.mktemp("upstream-async")
    path = work / "outcomes.json"
    command = [sys.executable, "-m", "pytest"] + upstream.run_args(
        root, tiny_model=tiny_model_path,
        outcomes=path) + ["-q", "-p", "no:warnings", "--tb=short"]
    run = subprocess.run(command,
                         cwd=work,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"),
                         capture_output=True,
                         text=True,
                         timeout=1200)
    # 1: some tests failed, as some must; anything else is a broken run.
    assert run.returncode in (0, 1) and path.exists(), (
        f"upstream's tests did not run ({run.returncode}):\n"
        f"{run.stdout[-6000:]}\n{run.stderr[-3000:]}")
    by_node = json.loads(path.read_text())
    prefix = f"{upstream.TEST_FILE}::"
    return {
        f"{prefix}{node.split('::', 1)[1]}": outcome
        for node, outcome in by_node.items()
    }


def test_every_pinned_upstream_test_ran_on_every_variant(outcomes):
    assert set(outcomes) == {
        node_id(test, variant)
        for test in UPSTREAM_TESTS
        for variant in upstream.VARIANTS
    }


@pytest.mark.parametrize("variant", upstream.VARIANTS)
@pytest.mark.parametrize(
    "test",
    UPSTREAM_TESTS,
    ids=[t.replace("[", "-").rstrip("]") for t in UPSTREAM_TESTS])
def test_upstream_test_outcome(outcomes, test, variant):
    """Passes where stock passes, or fails for its documented reason."""
    outcome = outcomes[node_id(test, variant)]
    reason = expected_failure(test, variant)
    if reason is None:
        assert outcome["outcome"] == "passed", outcome["message"]
    else:
        assert outcome["outcome"] == "failed", outcome
        assert reason in outcome["message"], outcome["message"]
    if variant == "plugin-idle":
        assert outcome.get("hook_samples", 0) == 0, outcome


def test_the_hooks_act_only_where_upstream_samples_their_ids(outcomes):
    """Under `plugin`, upstream's fake runners sample the hook ids in two
    tests (and spawn children in `test_abort`); no other test, and no
    `plugin-idle` test, samples a hook token."""
    sampled = {
        test
        for test in UPSTREAM_TESTS
        if outcomes[node_id(test, "plugin")].get("hook_samples", 0)
    }
    assert sampled == set(SAMPLE_HOOK_IDS)
    assert outcomes[node_id("test_abort", "plugin")]["children"] > 0
    assert not any(
        outcomes[node_id(test, "plugin-idle")].get("hook_samples", 0)
        for test in UPSTREAM_TESTS)
