# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The hooks' configuration is read and checked by one function,
`config.special_kwargs_of`, in each process that checks it: the API
process (`EngineArgs.create_engine_config`), the engine core (the
scheduler) and the workers (the request check). Each refusal is the same
text wherever it is found, and the setting is parsed and checked once a
process."""

import json

import pytest
import torch
from transformers import AutoTokenizer
from vllm_sequence_hooks.admission import HookedRequestCheck
from vllm_sequence_hooks.config import (CONFIG_KEY, SCHEDULER_CLS,
                                        special_kwargs_of)
from vllm_sequence_hooks.scheduler import SequenceHookScheduler

from sequence_hooks import SpecialKwargs
from sequence_hooks.formats.apr import APRPolicy
from sequence_hooks_testkit.v1_batch_queue import make_scheduler
from vllm.config import ModelConfig, SchedulerConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser


def api_process(model_path, special_kwargs):
    """What `vllm serve` and `LLM` build before any engine process."""
    return EngineArgs(model=str(model_path),
                      dtype="float32",
                      special_kwargs=special_kwargs).create_engine_config()


def engine_core(model_path, special_kwargs):
    return make_scheduler(SequenceHookScheduler, model_path, False,
                          special_kwargs)


def worker(model_path, special_kwargs):
    """The request check as each worker builds it, before the model."""
    config = VllmConfig(model_config=ModelConfig(model=str(model_path),
                                                 dtype="float32"),
                        scheduler_config=SchedulerConfig(
                            max_model_len=256,
                            is_encoder_decoder=False,
                            scheduler_cls=SCHEDULER_CLS),
                        additional_config={CONFIG_KEY: special_kwargs})
    return HookedRequestCheck(config, torch.device("cpu"), False)


@pytest.mark.parametrize("changes, reason", [
    ({
        "sync_token": "zz"
    }, "special_kwargs: sync_token 'zz' is not a single token"),
    ({
        "sync_token": None,
        "sync_token_id": 2
    }, "special_kwargs: token id(s) [2] are the model's end-of-sequence "
     "token"),
    ({
        "max_dept": 3
    }, "special_kwargs: 1 validation error for SpecialKwargs max_dept "
     "Unexpected keyword argument"),
],
                         ids=["not-one-token", "eos", "unknown-key"])
def test_a_bad_setting_has_one_reason_in_every_process(tiny_model_path,
                                                       hook_ids, changes,
                                                       reason):
    assert hook_ids.eos == 2
    special_kwargs = {
        "sync_token": "<sync>",
        "promise_token": "<promise>",
        **changes
    }
    reasons = []
    for check in (api_process, engine_core, worker):
        with pytest.raises(ValueError) as refusal:
            check(tiny_model_path, special_kwargs)
        reasons.append(str(refusal.value))
    assert reasons[0].startswith(reason), reasons[0]
    assert reasons == [reasons[0]] * 3


def test_the_check_runs_once_a_process(tiny_model_path, hook_ids, monkeypatch):
    """An engine whose core runs in the API process (`LLM` with
    `VLLM_ENABLE_V1_MULTIPROCESSING=0`) reaches all three checks there:
    the model is consulted once."""
    checks = []
    for_model = SpecialKwargs.for_model

    def counted(self, *args):
        checks.append(self)
        return for_model(self, *args)

    monkeypatch.setattr(SpecialKwargs, "for_model", counted)
    # A separator no other test uses: a configuration this process has not
    # checked yet.
    special_kwargs = {
        "sync_token": "<sync>",
        "promise_token": "<promise>",
        "child_role_token": "<child>",
        "merge_separator": " (checked once) "
    }
    vllm_config = api_process(tiny_model_path, special_kwargs)
    carried = vllm_config.additional_config[CONFIG_KEY]
    worker(tiny_model_path, carried)
    scheduler = engine_core(tiny_model_path, carried)
    assert len(checks) == 1
    resolved = scheduler.hooks.special_kwargs
    assert (resolved.sync_token_id, resolved.promise_token_id,
            resolved.child_role_token_id) == (hook_ids.sync, hook_ids.promise,
                                              hook_ids.child)
    assert special_kwargs_of(vllm_config) is resolved


def test_a_server_flag_is_parsed_once_in_the_api_process(
        tiny_model_path, monkeypatch):
    """`vllm serve --special-kwargs JSON` reads the flag in its argparse
    action, expands it into the settings it stands for and checks the
    engine's configuration: one parse, one check against the model."""
    parses, checks = [], []
    parse = SpecialKwargs.__dict__["parse"].__func__
    for_model = SpecialKwargs.for_model

    def counted_parse(cls, value):
        parses.append(value)
        return parse(cls, value)

    def counted_check(self, *args):
        checks.append(self)
        return for_model(self, *args)

    monkeypatch.setattr(SpecialKwargs, "parse", classmethod(counted_parse))
    monkeypatch.setattr(SpecialKwargs, "for_model", counted_check)
    # A separator no other test uses: a setting this process has not read.
    flag = json.dumps({
        "sync_token": "<sync>",
        "promise_token": "<promise>",
        "merge_separator": " (parsed once) "
    })
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args([
        "--model",
        str(tiny_model_path), "--dtype", "float32", "--special-kwargs", flag
    ])
    vllm_config = EngineArgs.from_cli_args(args).create_engine_config()
    assert parses == [flag]
    assert len(checks) == 1
    carried = vllm_config.additional_config[CONFIG_KEY]
    assert carried["merge_separator"] == " (parsed once) "
    # The engine core and the workers of this process read it again: no
    # new parse, no new check.
    worker(tiny_model_path, carried)
    engine_core(tiny_model_path, carried)
    assert (len(parses), len(checks)) == (1, 1)


def test_apr_from_the_flag_runs_its_lifecycle(tiny_model_path):
    """APR has no tags to check: the flag takes it, and the scheduler runs
    `APRPolicy` with the model's BOS as the text every call sends."""
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    flag = json.dumps({"format": "apr"})
    args = parser.parse_args([
        "--model",
        str(tiny_model_path), "--dtype", "float32", "--special-kwargs", flag
    ])
    carried = EngineArgs.from_cli_args(
        args).create_engine_config().additional_config[CONFIG_KEY]
    assert carried["format"] == "apr"
    coordinator = engine_core(tiny_model_path, carried).hooks.coordinator
    assert isinstance(coordinator.policy, APRPolicy)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    assert coordinator.policy.format.bos_token == tokenizer.bos_token


def test_a_format_whose_tags_the_model_lacks_is_refused_in_every_process(
        tiny_model_path):
    reasons = []
    for check in (api_process, engine_core, worker):
        with pytest.raises(ValueError) as refusal:
            check(tiny_model_path, {"format": "threadweaver"})
        reasons.append(str(refusal.value))
    assert reasons[0].startswith(
        "special_kwargs: format 'threadweaver': its outlines tag "
        "'<Outlines>' is not one token of the model"), reasons[0]
    assert reasons == [reasons[0]] * 3


def test_a_formats_tags_may_be_the_models_own_tokens(tiny_model_path,
                                                     hook_ids):
    """A model trained with other tags names them (`format_tags`): each
    process accepts them when each is one token, and the scheduler runs
    the format's lifecycle on them."""
    special_kwargs = {
        "format": "threadweaver",
        "format_tags": {
            "outlines": "<promise>",
            "trigger": "<sync>",
            "thread_end": "<child>"
        }
    }
    api_process(tiny_model_path, special_kwargs)
    worker(tiny_model_path, special_kwargs)
    scheduler = engine_core(tiny_model_path, special_kwargs)
    thread_format = scheduler.hooks.coordinator.policy.format
    assert (thread_format.outlines_id, thread_format.trigger_id,
            thread_format.thread_end_id) == (hook_ids.promise, hook_ids.sync,
                                             hook_ids.child)
