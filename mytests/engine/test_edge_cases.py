# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Bad `SpecialKwargs` and configurations the hooks cannot serve fail at
engine start (in `EngineArgs.create_engine_config`, before any model is
loaded) with a message saying why; the options hooks need are set for the
user when left at their defaults."""

import json

import pytest
from transformers import BartConfig

import vllm.envs as envs
from sequence_hooks_testkit.engines import engine_config
from vllm.config import SpecialKwargs
from vllm.core.scheduler import Scheduler
from vllm.core.sequence_hook_scheduler import SequenceHookScheduler
from vllm.engine.arg_utils import EngineArgs
from vllm.utils import FlexibleArgumentParser


def test_hooks_set_the_options_they_need(tiny_model_path, hooks):
    config = engine_config(tiny_model_path, special_kwargs=hooks)
    assert config.special_kwargs == SpecialKwargs(**hooks)
    assert config.scheduler_config.chunked_prefill_enabled
    assert not config.model_config.use_async_output_proc
    assert config.scheduler_config.scheduler_cls == (
        "vllm.core.sequence_hook_scheduler.SequenceHookScheduler")


def test_without_hooks_nothing_changes(tiny_model_path):
    config = engine_config(tiny_model_path)
    assert config.special_kwargs is None
    assert config.scheduler_config.scheduler_cls == (
        "vllm.core.scheduler.Scheduler")


def test_unset_engine_choice_selects_v0(tiny_model_path, hooks, monkeypatch):
    monkeypatch.delenv("VLLM_USE_V1")
    engine_config(tiny_model_path, special_kwargs=hooks)
    assert envs.is_set("VLLM_USE_V1") and not envs.VLLM_USE_V1


def test_subclass_of_the_hook_scheduler_is_kept(tiny_model_path, hooks):

    class MyScheduler(SequenceHookScheduler):
        pass

    config = engine_config(tiny_model_path,
                           special_kwargs=hooks,
                           scheduler_cls=MyScheduler)
    assert config.scheduler_config.scheduler_cls is MyScheduler


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({
            "enable_chunked_prefill": False
        }, "enable_chunked_prefill=False"),
        ({
            "num_scheduler_steps": 2
        }, "multi-step scheduling"),
        ({
            "pipeline_parallel_size": 2
        }, "pipeline parallelism"),
        ({
            "speculative_config": {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_max": 2
            }
        }, "speculative decoding"),
        ({
            "scheduler_cls": Scheduler
        }, "must subclass"),
        ({
            "skip_tokenizer_init": True
        }, "skip_tokenizer_init"),
        ({
            "preemption_mode": "swap"
        }, "preemption_mode='swap'"),
    ],
)
def test_conflicting_options_are_refused(tiny_model_path, hooks, options,
                                         reason):
    with pytest.raises(ValueError, match=reason):
        engine_config(tiny_model_path, special_kwargs=hooks, **options)


@pytest.mark.parametrize("name, missing", [
    ("threadweaver", "arrivals .*; branch_stops .*; conclude .*; restart "),
    ("apr", "arrivals .*; fresh_children .*; held_output .*; restart "),
    ("npr", "conclude .*; splice "),
    ("multiverse", "conclude .*; splice "),
])
def test_a_format_v0_does_not_serve_is_refused_at_start(
        tiny_model_path, name, missing):
    # V0 carries out forks on the parent's KV, parks and resumes only:
    # the refusal names each capability the format needs beyond them.
    with pytest.raises(ValueError,
                       match=f"^special_kwargs: format '{name}' is not "
                       "served by this engine, which does not carry out "
                       f"{missing}"):
        engine_config(tiny_model_path, special_kwargs={"format": name})


def test_v1_engine_is_refused(tiny_model_path, hooks, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V1", "1")
    with pytest.raises(ValueError, match="V1 engine"):
        engine_config(tiny_model_path, special_kwargs=hooks)


def test_encoder_decoder_model_is_refused(tmp_path, hooks):
    BartConfig(vocab_size=100,
               d_model=64,
               encoder_layers=1,
               decoder_layers=1,
               encoder_attention_heads=2,
               decoder_attention_heads=2,
               encoder_ffn_dim=64,
               decoder_ffn_dim=64,
               max_position_embeddings=128,
               architectures=["BartForConditionalGeneration"
                              ]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="encoder-decoder"):
        engine_config(tmp_path, special_kwargs=hooks)


def test_token_id_outside_the_vocabulary_is_refused(tiny_model_path, hooks):
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine_config(tiny_model_path,
                      special_kwargs=dict(hooks, sync_token_id=10_000))


@pytest.mark.parametrize(
    ("values", "reason"),
    [
        ({
            "sync_token_id": -1
        }, ">= 0"),
        ({
            "promise_token_id": "x"
        }, "promise_token_id"),
        ({
            "sync_token_id": 5,
            "promise_token_id": 5
        }, "must differ"),
        ({
            "child_role_token_id": 4
        }, "must differ"),
        ({
            "max_depth": 0
        }, "max_depth"),
        ({
            "sync_tokn_id": 4
        }, "sync_tokn_id"),
    ],
)
def test_invalid_special_kwargs_are_refused(values, reason):
    with pytest.raises(ValueError, match=reason):
        SpecialKwargs(**dict({
            "sync_token_id": 4,
            "promise_token_id": 5
        }, **values))


def test_special_kwargs_from_the_cli_as_json(tiny_model_path, hooks):
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args([
        "--model",
        str(tiny_model_path), "--max-model-len", "128", "--special-kwargs",
        json.dumps(dict(hooks, merge_separator=" ; "))
    ])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.special_kwargs == SpecialKwargs(**hooks,
                                                  merge_separator=" ; ")


def test_token_strings_are_resolved_at_start(tiny_model_path, hook_ids):
    config = engine_config(tiny_model_path,
                           special_kwargs={
                               "sync_token": "<sync>",
                               "promise_token": "<promise>",
                               "child_role_token": "<child>"
                           })
    assert config.special_kwargs == SpecialKwargs(
        sync_token_id=hook_ids.sync,
        promise_token_id=hook_ids.promise,
        child_role_token_id=hook_ids.child)


@pytest.mark.parametrize(("token", "reason"), [
    ("the cat", "not a single token"),
    ("<nope>", "not a single token"),
])
def test_token_string_that_is_not_one_token_is_refused(tiny_model_path, token,
                                                       reason):
    with pytest.raises(ValueError, match=reason):
        engine_config(tiny_model_path,
                      special_kwargs={
                          "sync_token": token,
                          "promise_token": "<promise>"
                      })


@pytest.mark.parametrize(("values", "reason"), [
    ({
        "sync_token_id": 4,
        "sync_token": "<sync>",
        "promise_token_id": 5
    }, "not both"),
    ({
        "promise_token_id": 5
    }, "sync_token_id or sync_token is required"),
    ({
        "sync_token": "<x>",
        "promise_token": "<x>"
    }, "must differ"),
])
def test_token_ids_and_strings_are_checked(values, reason):
    with pytest.raises(ValueError, match=reason):
        SpecialKwargs(**values)


def test_from_json_reads_what_the_cli_takes():
    assert SpecialKwargs.from_json(
        '{"sync_token": "<sync>", "promise_token_id": 5, "max_depth": 3}'
    ) == SpecialKwargs(sync_token="<sync>", promise_token_id=5, max_depth=3)
    with pytest.raises(ValueError, match="unknown_key"):
        SpecialKwargs.from_json('{"sync_token_id": 4, "promise_token_id": 5,'
                                ' "unknown_key": 1}')


def test_hook_token_equal_to_eos_is_refused(tiny_model_path, hook_ids):
    with pytest.raises(ValueError, match="end-of-sequence"):
        engine_config(tiny_model_path,
                      special_kwargs={
                          "sync_token_id": hook_ids.eos,
                          "promise_token_id": hook_ids.promise
                      })
