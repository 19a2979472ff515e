# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tripwires: the upstream symbols our patches and modules rely on.

If upstream moves one of them (a new pin, a changed signature), these fail
naming it, before any behaviour test has to be debugged. Three kinds:

- the symbols each patch touches, as pristine upstream has them;
- the same symbols after patching, with the shape we gave them;
- unpatched upstream symbols our modules call, override or read.
"""

import ast
import inspect

import build_fork
import pytest

# Upstream file -> {function (Class.method or module function): its
# parameters, pristine}, with the patch (patches/<kind>/<number>) touching it.
PATCHED_FUNCTIONS = {
    # features/0004
    "vllm/engine/output_processor/interfaces.py": {
        "SequenceGroupOutputProcessor.create_output_processor": [
            "scheduler_config", "detokenizer", "scheduler", "seq_counter",
            "get_tokenizer_for_seq", "stop_checker"
        ],
    },
    "vllm/engine/llm_engine.py": {
        # features/0004
        "LLMEngine.__init__": [
            "self", "vllm_config", "executor_class", "log_stats",
            "usage_context", "stat_loggers", "mm_registry",
            "use_cached_outputs"
        ],
        # hardening/0002
        "LLMEngine._validate_model_input":
        ["self", "prompt_inputs", "lora_request", "prompt_type"],
    },
    # features/0003
    "vllm/engine/arg_utils.py": {
        "EngineArgs.create_engine_config": ["self", "usage_context"],
        "EngineArgs.add_cli_args": ["parser"],
    },
    # features/0005
    "vllm/outputs.py": {
        "RequestOutput.__init__": [
            "self", "request_id", "prompt", "prompt_token_ids",
            "prompt_logprobs", "outputs", "finished", "metrics",
            "lora_request", "encoder_prompt", "encoder_prompt_token_ids",
            "num_cached_tokens", "multi_modal_placeholders",
            "kv_transfer_params", "kwargs"
        ],
        "RequestOutput.from_seq_group":
        ["cls", "seq_group", "use_cache", "seq_id_to_seq_group"],
    },
    # features/0001
    "vllm/sequence.py": {
        "SequenceStatus.is_finished": ["status"],
    },
    # hardening/0001
    "vllm/model_executor/layers/logits_processor.py": {
        "_apply_logits_processors": ["logits", "sampling_metadata"],
        "_apply_logits_processors_single_seq": [
            "logits_row", "logits_processors", "past_tokens_ids",
            "prompt_tokens_ids"
        ],
    },
    # hardening/0002
    "vllm/entrypoints/openai/serving_engine.py": {
        "OpenAIServing._normalize_prompt_text_to_input": [
            "self", "request", "tokenizer", "prompt", "truncate_prompt_tokens",
            "add_special_tokens"
        ],
        "OpenAIServing._normalize_prompt_tokens_to_input": [
            "self", "request", "tokenizer", "prompt_ids",
            "truncate_prompt_tokens"
        ],
        "OpenAIServing._load_prompt_embeds":
        ["self", "prompt_embeds", "truncate_prompt_tokens"],
    },
    # features/0006
    "vllm/entrypoints/openai/serving_completion.py": {
        "OpenAIServingCompletion.create_completion":
        ["self", "request", "raw_request"],
    },
    # features/0006
    "vllm/entrypoints/openai/serving_chat.py": {
        "OpenAIServingChat.create_chat_completion":
        ["self", "request", "raw_request"],
    },
    # features/0006
    "vllm/entrypoints/llm.py": {
        "LLM.beam_search":
        ["self", "prompts", "params", "lora_request", "use_tqdm"],
    },
    # hardening/0003
    "vllm/engine/async_llm_engine.py": {
        "build_guided_decoding_logits_processor_async": [
            "sampling_params", "tokenizer", "default_guided_backend",
            "reasoning_backend", "model_config"
        ],
    },
    # hardening/0004
    "vllm/engine/multiprocessing/client.py": {
        "MQLLMEngineClient.close": ["self"],
    },
}


def parameters(node) -> list[str]:
    """Parameter names of a function's AST node, in order."""
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    names += [a.arg for a in (args.vararg, args.kwarg) if a]
    return names


def upstream_functions(relative_path: str) -> dict[str, list[str]]:
    """Module functions and methods of a pristine upstream file, with their
    parameters."""
    tree = ast.parse(
        (build_fork.pristine_tree("cpu") / relative_path).read_text())
    found = {}
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, functions):
            found[node.name] = parameters(node)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, functions):
                    found[f"{node.name}.{item.name}"] = parameters(item)
    return found


@pytest.mark.parametrize("relative_path", sorted(PATCHED_FUNCTIONS))
def test_patched_functions_have_their_upstream_shape(relative_path):
    found = upstream_functions(relative_path)
    for name, params in PATCHED_FUNCTIONS[relative_path].items():
        assert name in found, f"upstream {relative_path} lost {name}"
        assert found[name] == params, f"upstream {name} changed shape"


def test_upstream_sequence_status_values():
    source = (build_fork.pristine_tree("cpu") / "vllm/sequence.py").read_text()
    assert ("    SWAPPED = 2\n    # Note: anything after SWAPPED (2) will be "
            "considered\n    # as a finished status.\n    FINISHED_STOPPED = 3"
            in source)
    assert "return status > SequenceStatus.SWAPPED" in source


def test_patched_shapes():
    from vllm.config import SpecialKwargs, VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.engine.output_processor.interfaces import (
        SequenceGroupOutputProcessor)
    from vllm.inputs import token_inputs
    from vllm.outputs import RequestOutput
    from vllm.sequence import Sequence, SequenceGroup, SequenceStatus

    factory = inspect.signature(
        SequenceGroupOutputProcessor.create_output_processor).parameters
    assert list(factory)[-3:] == [
        "special_kwargs", "seq_id_to_seq_group", "served_model_name"
    ]
    assert SequenceStatus.BLOCKED == 3
    assert SequenceStatus.FINISHED_STOPPED == 4
    group = SequenceGroup("0", [Sequence(0, token_inputs([1, 2]), 4)], 0.0)
    assert group.first_seq.promise_tree is None
    assert "promise_tree" in inspect.signature(RequestOutput).parameters
    assert VllmConfig.__dataclass_fields__["special_kwargs"].default is None
    assert EngineArgs.__dataclass_fields__["special_kwargs"].default is None
    assert SpecialKwargs.__module__ == "sequence_hooks.special_kwargs"


def params_of(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_upstream_symbols_our_modules_rely_on():
    from vllm.core.block_manager import SelfAttnBlockSpaceManager
    from vllm.core.scheduler import Scheduler
    from vllm.engine.output_processor.single_step import (
        SingleStepOutputProcessor)
    from vllm.sequence import Sequence, SequenceData, SequenceGroupBase
    from vllm.transformers_utils.detokenizer import Detokenizer

    # SequenceHookScheduler overrides these and calls super().
    assert params_of(Scheduler.abort_seq_group) == [
        "self", "request_id", "seq_id_to_seq_group"
    ]
    assert params_of(Scheduler.has_unfinished_seqs) == ["self"]
    assert params_of(Scheduler.get_num_unfinished_seq_groups) == ["self"]
    assert params_of(Scheduler.fork_seq) == ["self", "parent_seq", "child_seq"]
    # Called by upstream before it preempts for lack of a block; overridden
    # to evict parked groups first (prefix caching on).
    assert params_of(Scheduler._can_append_slots) == [
        "self", "seq_group", "enable_chunking"
    ]
    assert "self._can_append_slots(" in inspect.getsource(
        Scheduler._schedule_running)
    assert params_of(
        SelfAttnBlockSpaceManager.fork) == ["self", "parent_seq", "child_seq"]
    # SequenceHookOutputProcessor subclasses this and calls super().
    assert params_of(SingleStepOutputProcessor.__init__) == [
        "self", "scheduler_config", "detokenizer", "scheduler", "seq_counter",
        "stop_checker"
    ]
    assert params_of(SingleStepOutputProcessor.process_outputs) == [
        "self", "sequence_group", "outputs", "is_async"
    ]
    assert params_of(
        Detokenizer.decode_sequence_inplace) == ["self", "seq", "prms"]
    assert params_of(Sequence.fork) == ["self", "new_seq_id"]
    # PromiseTreeGroup is registered like ParallelSampleSequenceGroup.
    assert {"group_id", "seq_id_to_index",
            "to_be_finished"} <= set(SequenceGroupBase.__dataclass_fields__)
    # A merge moves the stage back to PREFILL; computing the tail moves it
    # forward again.
    assert "_stage" in SequenceData.__struct_fields__
    assert "self._stage = SequenceStage.DECODE" in inspect.getsource(
        SequenceData.update_num_computed_tokens)


def function_source(relative_path: str, qualname: str) -> str:
    """A pristine upstream function's source, whitespace folded."""
    source = (build_fork.pristine_tree("cpu") / relative_path).read_text()
    class_name, name = qualname.split(".")
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, functions) and item.name == name:
                    return " ".join(
                        ast.get_source_segment(source, item).split())
    raise AssertionError(f"upstream {relative_path} lost {qualname}")


def test_engine_processes_the_scheduled_groups_in_order():
    """`V0PromiseAdapter` tells whether a group was processed earlier
    in a step from its place in the scheduler's outputs: the engine must
    process them in that order, skip a group that is finished when its
    turn comes (no output), and make an output for every other processed
    group, even one finished later in the step."""
    loop = function_source("vllm/engine/llm_engine.py",
                           "LLMEngine._process_model_outputs")
    for step in [
            "indices = range(len(seq_group_metadata_list))",
            "for i in indices: if i in skip: continue",
            "scheduled_seq_group = scheduler_outputs.scheduled_seq_groups[i]",
            "if seq_group.is_finished(): finished_before.append(i) continue",
            "self.output_processor.process_prompt_logprob(seq_group, output) "
            "if seq_group_meta.do_sample: self.output_processor."
            "process_outputs( seq_group, output, is_async)",
            "if i in skip or i in finished_before or i in finished_now: "
            "continue",
            "request_output = RequestOutputFactory.create( seq_group, "
            "self.seq_id_to_seq_group, use_cache=self.use_cached_outputs)",
    ]:
        assert step in loop, f"LLMEngine._process_model_outputs: {step!r}"


def test_client_requests_end_on_an_error_in_their_queue():
    """hardening/0004 ends every open request at shutdown by putting an
    error into its output queue and marking the client errored: a request
    must raise what it finds in its queue, not send its abort when the
    client is errored, and leave its queue on the way out."""
    request = function_source("vllm/engine/multiprocessing/client.py",
                              "MQLLMEngineClient._process_request")
    for step in [
            "self.output_queues[request_id] = queue",
            "request_output = await queue.get() if isinstance("
            "request_output, BaseException): raise request_output",
            "if not finished and not self.errored: "
            "await self.abort(request_id)",
            "finally: self.output_queues.pop(request_id)",
    ]:
        assert step in request, f"MQLLMEngineClient._process_request: {step!r}"
