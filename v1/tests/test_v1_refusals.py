# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the plugin's scheduler refuses at start, as V0 refuses it, each
with its reason (model-free: the scheduler is made as the engine core
makes it)."""

from unittest.mock import MagicMock

import pytest
from vllm_sequence_hooks.scheduler import SequenceHookScheduler

from sequence_hooks_testkit.v1_batch_queue import make_scheduler
from vllm.config import SpeculativeConfig


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


def test_speculative_decoding_is_refused(tiny_model_path, hook_ids):
    with pytest.raises(ValueError, match="speculative decoding"):
        make_scheduler(SequenceHookScheduler,
                       tiny_model_path,
                       False,
                       hooks(hook_ids),
                       speculative_config=MagicMock(spec=SpeculativeConfig))


def test_hooks_without_their_configuration_are_refused(tiny_model_path):
    with pytest.raises(ValueError, match="additional_config"):
        make_scheduler(SequenceHookScheduler, tiny_model_path, False)
