# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the plugin refuses, as V0 refuses it, each with its reason: at
start, the scheduler (made as the engine core makes it, no model), the
request check (`admission.HookedRequestCheck`, made as a worker makes it);
per request, structured outputs, offline and on the hooked engine. What
`vllm serve` refuses before any engine starts: test_v1_one_flag.py."""

from unittest.mock import MagicMock

import pytest
import torch
from vllm_sequence_hooks.admission import (STRUCTURED_OUTPUTS,
                                           HookedRequestCheck)
from vllm_sequence_hooks.config import SCHEDULER_CLS
from vllm_sequence_hooks.config_check import HooksConfigCheck
from vllm_sequence_hooks.scheduler import SequenceHookScheduler

from sequence_hooks_testkit.conformance import hook_metric
from sequence_hooks_testkit.v1_batch_queue import make_scheduler
from sequence_hooks_testkit.v1_engines import assert_engine_clean
from vllm import SamplingParams
from vllm.config import (CacheConfig, ModelConfig, SchedulerConfig,
                         SpeculativeConfig, VllmConfig)
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import BeamSearchParams, StructuredOutputsParams


def hooks(hook_ids, **changes):
    return {
        "sync_token_id": hook_ids.sync,
        "promise_token_id": hook_ids.promise,
        **changes
    }


def test_a_hook_token_that_is_eos_is_refused(tiny_model_path, hook_ids):
    with pytest.raises(ValueError,
                       match=rf"special_kwargs: token id\(s\) "
                       rf"\[{hook_ids.eos}\] are the model's end-of-sequence"):
        make_scheduler(SequenceHookScheduler, tiny_model_path, False,
                       hooks(hook_ids, sync_token_id=hook_ids.eos))


def test_a_token_string_not_in_the_vocabulary_is_refused(
        tiny_model_path, hook_ids):
    with pytest.raises(ValueError,
                       match="special_kwargs: promise_token '<nope>' is not "
                       "a single token"):
        make_scheduler(SequenceHookScheduler, tiny_model_path, False, {
            "sync_token_id": hook_ids.sync,
            "promise_token": "<nope>"
        })


@pytest.mark.parametrize("setting, reason", [
    ("speculative_config", "speculative decoding"),
    ("cache_config", "keep enable_prefix_caching on"),
    ("model_config", "cannot run with skip_tokenizer_init"),
])
def test_a_setting_the_hooks_cannot_serve_is_refused_by_the_scheduler(
        tiny_model_path, hook_ids, setting, reason):
    """For an engine built without `EngineArgs` (whose
    `create_engine_config` refuses them first: test_v1_one_flag.py)."""
    changed = {
        "speculative_config":
        MagicMock(spec=SpeculativeConfig),
        "cache_config":
        CacheConfig(block_size=16, enable_prefix_caching=False),
        "model_config":
        ModelConfig(model=str(tiny_model_path),
                    dtype="float32",
                    skip_tokenizer_init=True),
    }[setting]
    with pytest.raises(ValueError, match=f"special_kwargs: .*{reason}"):
        make_scheduler(SequenceHookScheduler, tiny_model_path, False,
                       hooks(hook_ids), **{setting: changed})


def test_hooks_without_their_configuration_are_refused(tiny_model_path):
    with pytest.raises(ValueError, match="additional_config"):
        make_scheduler(SequenceHookScheduler, tiny_model_path, False)


def test_hooks_without_the_request_check_are_refused(tiny_model_path,
                                                     hook_ids):
    with pytest.raises(ValueError,
                       match="need --logits-processors "
                       "vllm_sequence_hooks.admission:HookedRequestCheck"):
        make_scheduler(SequenceHookScheduler,
                       tiny_model_path,
                       False,
                       hooks(hook_ids),
                       request_check=False)


def worker_config(model_path, scheduler_cls, special_kwargs):
    """The configuration a worker builds its logits processors from."""
    return VllmConfig(model_config=ModelConfig(model=str(model_path),
                                               dtype="float32"),
                      scheduler_config=SchedulerConfig(
                          max_model_len=256,
                          is_encoder_decoder=False,
                          scheduler_cls=scheduler_cls),
                      additional_config={"special_kwargs": special_kwargs})


@pytest.mark.parametrize(
    "scheduler_cls",
    [None, "vllm.v1.core.sched."
     "async_scheduler.AsyncScheduler"])
def test_the_request_check_refuses_hooks_without_their_scheduler(
        tiny_model_path, hook_ids, scheduler_cls):
    """`--additional-config` with hooks and `--logits-processors` but no
    `--scheduler-cls`: refused as the worker starts, before the model
    loads, instead of running without hooks."""
    config = worker_config(tiny_model_path, scheduler_cls, hooks(hook_ids))
    with pytest.raises(ValueError,
                       match=f"needs --scheduler-cls "
                       f"{SCHEDULER_CLS}"):
        HookedRequestCheck(config, torch.device("cpu"), False)


def test_the_request_check_refuses_a_bad_configuration_before_the_model(
        tiny_model_path, hook_ids):
    config = worker_config(tiny_model_path, SCHEDULER_CLS,
                           hooks(hook_ids, sync_token_id=hook_ids.eos))
    with pytest.raises(ValueError, match="special_kwargs: token id"):
        HookedRequestCheck(config, torch.device("cpu"), False)
    good = worker_config(tiny_model_path, SCHEDULER_CLS, hooks(hook_ids))
    check = HookedRequestCheck(good, torch.device("cpu"), False)
    logits = torch.randn(2, 8)
    assert check.apply(logits) is logits and check.is_argmax_invariant()


@pytest.mark.parametrize("structured", [
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(regex=".*"),
    StructuredOutputsParams(choice=["a", "b"]),
],
                         ids=["json_object", "regex", "choice"])
def test_structured_outputs_are_refused_before_the_engine(
        hooked_llm, structured):
    """Offline, as the server's 400: V1 turns a request check's
    `ValueError` into its `VLLMValidationError` (V0 raises `ValueError`).
    `regex ".*"` hung its request before the check existed."""
    params = SamplingParams(max_tokens=4, structured_outputs=structured)
    with pytest.raises(VLLMValidationError) as refusal:
        hooked_llm.generate("the cat sees", params, use_tqdm=False)
    assert STRUCTURED_OUTPUTS in str(refusal.value)
    # The engine still serves the next request.
    [output] = hooked_llm.generate("the cat sees",
                                   SamplingParams(max_tokens=4,
                                                  ignore_eos=True),
                                   use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4


def test_hooks_without_the_scheduler_are_refused_by_every_engine(
        tiny_model_path, hook_ids):
    """`--additional-config` with `special_kwargs` alone would run without
    hooks: the plugin's entry-point logits processor, which vLLM builds in
    every worker before the model loads, refuses it; it is inert on an
    engine without hooks."""
    from vllm.v1.sample.logits_processor import _load_custom_logitsprocs
    assert HooksConfigCheck in _load_custom_logitsprocs(None)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError,
                       match="additional_config has 'special_kwargs' but "
                       "--scheduler-cls is not"):
        HooksConfigCheck(worker_config(tiny_model_path, None, hooks(hook_ids)),
                         cpu, False)
    HooksConfigCheck(
        worker_config(tiny_model_path, SCHEDULER_CLS, hooks(hook_ids)), cpu,
        False)
    plain = VllmConfig(
        model_config=ModelConfig(model=str(tiny_model_path), dtype="float32"))
    logits = torch.randn(2, 8)
    assert HooksConfigCheck(plain, cpu, False).apply(logits) is logits


def test_offline_beam_search_runs_without_hooks(hooked_llm, hook_ids):
    """Pinned upstream difference: `LLM.beam_search` runs in the frontend
    as one-token requests, which no plugin code sees as beam search (the
    server refuses it: `beam_search.RefuseBeamSearch`). A beam that takes
    `<promise>` takes it as an ordinary token: its one-token request ends
    in the step that sampled it, so nothing spawns, and a later step's
    request has it in its prompt, where hooks never act."""
    before = hook_metric(hooked_llm, "promises_spawned_total")
    # After this prompt `<promise>` is the tiny model's 3rd choice, so a
    # beam of 4 keeps it.
    outputs = hooked_llm.beam_search([{
        "prompt_token_ids": [16, 7]
    }], BeamSearchParams(beam_width=4, max_tokens=1))
    beams = outputs[0].sequences
    assert [16, 7, hook_ids.promise] in [beam.tokens for beam in beams]
    assert hook_metric(hooked_llm, "promises_spawned_total") == before
    assert_engine_clean(hooked_llm)
