# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The hooks' one setting (`engine_args`): `--special-kwargs` on `vllm
serve`, `special_kwargs=` on `EngineArgs` and `LLM` (the whole suite's
engines are made with it, `v1_engines.v1_llm`), what they expand into,
and what `vllm serve` refuses before any engine process starts, its
reason the last line it prints."""

import argparse
import json
import os
import subprocess
import sys

import pytest
import requests
from vllm_sequence_hooks import hooked_engine_args
from vllm_sequence_hooks.config import (CONFIG_KEY, MIDDLEWARE, REQUEST_CHECK,
                                        SCHEDULER_CLS)
from vllm_sequence_hooks.engine_args import expand_parsed_args

from sequence_hooks import SpecialKwargs
from sequence_hooks_testkit.cli_forks import ForkedCommands
from sequence_hooks_testkit.v1_server import (REQUEST_TIMEOUT_S,
                                              SPECIAL_KWARGS, START_TIMEOUT_S,
                                              free_port, hooked_v1_server,
                                              scripted_body, serve_command)
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

FIELDS = {
    name: getattr(SpecialKwargs(**SPECIAL_KWARGS), name)
    for name in SpecialKwargs.__dataclass_fields__
}
MINE = "my_package.processors:Mine"


@pytest.mark.parametrize("special_kwargs", [
    SPECIAL_KWARGS,
    json.dumps(SPECIAL_KWARGS),
    SpecialKwargs(**SPECIAL_KWARGS)
],
                         ids=["dict", "json", "SpecialKwargs"])
def test_special_kwargs_expands_into_the_settings_it_stands_for(
        tiny_model_path, special_kwargs):
    args = EngineArgs(model=str(tiny_model_path),
                      special_kwargs=special_kwargs,
                      logits_processors=[MINE])
    assert args.scheduler_cls == SCHEDULER_CLS
    assert args.additional_config == {CONFIG_KEY: FIELDS}
    # The caller's processors run beside the hooks' request check.
    assert args.logits_processors == [MINE, REQUEST_CHECK]
    alone = EngineArgs(model=str(tiny_model_path),
                       special_kwargs=special_kwargs)
    assert {
        name: getattr(alone, name)
        for name in hooked_engine_args(special_kwargs)
    } == hooked_engine_args(special_kwargs)


@pytest.mark.parametrize("conflict, reason", [
    ({
        "scheduler_cls": "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
    }, "scheduler_cls='vllm.v1.core.sched.async_scheduler.AsyncScheduler' "
     "given beside it conflicts"),
    ({
        "additional_config": {
            CONFIG_KEY: {
                **SPECIAL_KWARGS, "max_depth": 3
            }
        }
    }, "conflict: give the hooks once"),
],
                         ids=["scheduler", "other-hooks"])
def test_a_setting_that_conflicts_with_special_kwargs_is_refused(
        tiny_model_path, conflict, reason):
    with pytest.raises(ValueError, match=reason):
        AsyncEngineArgs(model=str(tiny_model_path),
                        special_kwargs=SPECIAL_KWARGS,
                        **conflict)


def test_the_flag_parses_into_upstream_flags(tiny_model_path):
    """What `vllm serve` does with it: parsed, then expanded in place by
    `from_cli_args`, so upstream reads its own flags from there on."""
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args([
        "--model",
        str(tiny_model_path), "--special-kwargs",
        json.dumps(SPECIAL_KWARGS), "--logits-processors", MINE
    ])
    assert args.special_kwargs == FIELDS
    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert engine_args.scheduler_cls == SCHEDULER_CLS
    assert engine_args.additional_config == {CONFIG_KEY: FIELDS}
    assert engine_args.logits_processors == [MINE, REQUEST_CHECK]
    # A server's arguments (`build_app` reads `middleware`), expanded by
    # each API server process: the same the second time.
    served = argparse.Namespace(special_kwargs=FIELDS,
                                middleware=["my_package.Middleware"],
                                scheduler_cls=None,
                                additional_config={},
                                logits_processors=None)
    expand_parsed_args(served)
    once = dict(vars(served))
    expand_parsed_args(served)
    assert vars(served) == once
    assert served.middleware == ["my_package.Middleware", *MIDDLEWARE]
    assert served.logits_processors == [REQUEST_CHECK]


@pytest.mark.parametrize(
    "special_kwargs, reason", [
        ({
            **SPECIAL_KWARGS, "sync_tokn": "<sync>"
        }, "sync_tokn"),
        ({
            "format": "treeweaver"
        }, "unknown format 'treeweaver' (known: promise_sync, threadweaver, "
         "apr, npr, multiverse)"),
        ({
            "format": "threadweaver",
            "sync_token": "<sync>"
        }, "format 'threadweaver' reads its own tags: sync_token given beside "
         "it belong to promise_sync"),
    ],
    ids=["unknown-key", "unknown-format", "format-and-promise-sync"])
def test_a_bad_flag_is_a_usage_error(tiny_model_path, capsys, special_kwargs,
                                     reason):
    """Refused by the flag's argparse action, as `vllm serve` parses its
    arguments, with the reason."""
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([
            "--model",
            str(tiny_model_path), "--special-kwargs",
            json.dumps(special_kwargs)
        ])
    assert exit_.value.code == 2
    error = " ".join(capsys.readouterr().err.split())
    assert "argument --special-kwargs:" in error and reason in error, error


def test_without_the_import_special_kwargs_is_an_unknown_keyword(
        tiny_model_path):
    """Documented (docs/v1.md): vLLM loads plugins only as it builds engine
    arguments, so in a fresh process `special_kwargs=` needs `import
    vllm_sequence_hooks` first."""
    code = ("from vllm import EngineArgs\n"
            "try:\n"
            f"    EngineArgs(model={str(tiny_model_path)!r}, "
            f"special_kwargs={SPECIAL_KWARGS!r})\n"
            "except TypeError as e:\n"
            "    print('TypeError', e)\n")
    out = subprocess.run([sys.executable, "-c", code],
                         capture_output=True,
                         text=True,
                         timeout=START_TIMEOUT_S,
                         check=True).stdout
    assert "TypeError" in out and "special_kwargs" in out, out


@pytest.fixture(scope="module")
def vllm_command(tmp_path_factory):
    """Runs `vllm` command lines as the `vllm` command does, each in a
    process of its own, with vLLM imported once for the module
    (`cli_forks`), in the environment of a served test."""
    with ForkedCommands(sys.executable,
                        dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1"),
                        tmp_path_factory.mktemp("vllm-command")) as commands:
        yield commands


@pytest.mark.parametrize("option", ["--help", "--help=special-kwargs"])
def test_serve_help_lists_the_flag(vllm_command, option):
    """Plain `--help` lists the config groups (upstream shows no flag
    there), the hooks' among them; `--help=special-kwargs` the flag."""
    out = vllm_command.run(["serve", option],
                           START_TIMEOUT_S,
                           errors_apart=True).output
    if option == "--help":
        [line] = [line for line in out.splitlines() if "SequenceHooks" in line]
        assert "--special-kwargs" in line, out
    else:
        assert "--special-kwargs" in out and "Sequence hooks" in out, out


@pytest.mark.parametrize("special_kwargs, extra, reason", [
    ({
        **SPECIAL_KWARGS, "bogus": 1
    }, (), "vllm serve: error: argument --special-kwargs:"),
    ({
        "sync_token": "<sync>"
    }, (), "promise_token_id or promise_token is required"),
    ({
        **SPECIAL_KWARGS, "sync_token": "zz"
    }, (), "ValueError: special_kwargs: sync_token 'zz' is not a single "
     "token"),
    ({
        "sync_token_id": 2,
        "promise_token": "<promise>"
    }, (), "ValueError: special_kwargs: token id(s) [2] are the model's "
     "end-of-sequence"),
    (SPECIAL_KWARGS, ("--skip-tokenizer-init", ),
     "ValueError: special_kwargs: sequence hooks cannot run with "
     "skip_tokenizer_init"),
    (SPECIAL_KWARGS, ("--no-enable-prefix-caching", ),
     "ValueError: special_kwargs: sequence hooks on V1 share the parent's "
     "KV blocks through the prefix cache"),
    (SPECIAL_KWARGS,
     ("--speculative-config", '{"method": "ngram", "num_speculative_tokens"'
      ': 2, "prompt_lookup_max": 2}'),
     "ValueError: special_kwargs: sequence hooks do not support "
     "speculative decoding"),
    (SPECIAL_KWARGS,
     ("--scheduler-cls", "vllm.v1.core.sched.scheduler.Scheduler"),
     "ValueError: special_kwargs runs the hooks' scheduler"),
    ({
        "format": "threadweaver"
    }, (), "ValueError: special_kwargs: format 'threadweaver': its outlines "
     "tag '<Outlines>' is not one token of the model"),
],
                         ids=[
                             "unknown-key", "no-promise", "not-one-token",
                             "eos", "skip-tokenizer-init", "no-prefix-caching",
                             "speculative-decoding", "other-scheduler",
                             "format-tags-not-tokens"
                         ])
def test_vllm_serve_refuses_bad_hooks_before_any_engine_starts(
        vllm_command, tiny_model_path, hook_ids, special_kwargs, extra,
        reason):
    assert hook_ids.eos == 2
    # The command line without the command's path.
    _, *args = serve_command(tiny_model_path, free_port(), extra,
                             special_kwargs)
    result = vllm_command.run(args, START_TIMEOUT_S)
    log = result.output
    assert result.returncode != 0, log[-2000:]
    # No engine core process ever logged.
    assert "EngineCore" not in log, log[-2000:]
    last = log.strip().splitlines()[-1]
    assert reason in last, last


def test_the_five_flag_form_still_serves(tiny_model_path, hook_ids, tmp_path):
    with hooked_v1_server(tiny_model_path, tmp_path, five_flags=True) as url:
        plans = {
            (): [None, hook_ids.promise, hook_ids.sync, None],
            (0, ): [None] * 3
        }
        answer = requests.post(url + "/v1/completions",
                               json=scripted_body(plans, hook_ids,
                                                  tiny_model_path, False),
                               timeout=REQUEST_TIMEOUT_S)
        assert answer.status_code == 200, answer.text
        tree = answer.json()["kv_transfer_params"]["promise_tree"]
        # Its three words and its end-of-sequence token.
        assert [len(child["token_ids"]) for child in tree["children"]] == [4]
