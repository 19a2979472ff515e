# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""No request can take the server down (issue 15), on real `vllm serve`.

Two servers on loopback on the tiny model: one with sequence hooks (the
suite's shared one: its requests run a promise/sync program, so the
hooks act on every option sent to it) and one stock. The regression
tests cover each fault found; the sweep sends every request field of
the completions and chat APIs to both. After every request each server
must answer `/health` and give its known request its known answer.
"""

import concurrent.futures
from dataclasses import dataclass, field
from typing import Optional

import pytest

from sequence_hooks_testkit.served import (chat, completion, start, stop,
                                           wait_ready)
from sequence_hooks_testkit.server import scripted_request_body
from sequence_hooks_testkit.tiny_model import build_tokenizer
from vllm import SamplingParams
from vllm.entrypoints.openai.protocol import (ChatCompletionRequest,
                                              CompletionRequest)
from vllm.sampling_params import BeamSearchParams

# The shared servers its tests use (conftest's `shared_servers`).
pytestmark = pytest.mark.shares("hooked")

VOCAB_SIZE = len(build_tokenizer())
HOOKS_REFUSE = "sequence hooks"


@pytest.fixture(scope="module")
def servers(tiny_model_path, hook_ids, tmp_path_factory, shared_servers):
    """The suite's shared hooked server and a stock one (started first:
    the two start at once when the hooked one is not running yet)."""
    stock = start("stock", tiny_model_path,
                  tmp_path_factory.mktemp("fault-servers") / "stock.log",
                  hook_ids)
    try:
        hooked = shared_servers.get("hooked")
        wait_ready(stock)
        yield {"hooked": hooked, "stock": stock}
    finally:
        stop(stock)


@pytest.fixture(params=["hooked", "stock"])
def served(request, servers):
    return servers[request.param]


def test_json_object_is_refused_naming_the_field(served):
    # The tiny vocabulary has no token that can begin JSON: xgrammar left
    # nothing allowed and the engine died on `assert accept_token`.
    for path, body in (("/v1/completions",
                        completion(served,
                                   response_format={"type": "json_object"})),
                       ("/v1/chat/completions",
                        chat(served, response_format={"type":
                                                      "json_object"}))):
        reply = served.post(path, body)
        assert reply.status == 400, reply.text
        if served.hooked:
            assert "response_format json_object" in reply.error_message
            assert HOOKS_REFUSE in reply.error_message
        else:
            assert "json_object" in reply.error_message
            assert "no token of this model's vocabulary" in (
                reply.error_message)
        served.assert_still_serving()


def test_grammar_dead_end_mid_output_ends_only_that_request(servers):
    # "cat dog": after "cat" the grammar needs " dog", which no token of
    # the word-level vocabulary spells; the request ends there.
    stock = servers["stock"]
    reply = stock.post(
        "/v1/completions",
        completion(stock,
                   guided_regex="cat dog",
                   guided_decoding_backend="xgrammar"))
    assert reply.status == 200, reply.text
    [choice] = reply.body["choices"]
    assert choice["text"].strip() == "cat"
    assert choice["finish_reason"] == "stop"
    stock.assert_still_serving()


def test_raising_logits_processor_ends_only_its_request(served, hook_ids):
    # A program forcing a token id the logits row does not have: the
    # processor raises IndexError inside the engine step.
    bad_plans = {(): [None, 10**6]}
    faulty = completion(served, **scripted_request_body(bad_plans, hook_ids))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        known = [pool.submit(served.known_answer) for _ in range(3)]
        reply = pool.submit(served.post, "/v1/completions", faulty).result()
        assert [k.result() for k in known] == [served.known_text] * 3
    assert reply.status == 200, reply.text
    [choice] = reply.body["choices"]
    assert choice["finish_reason"] == "stop"
    assert len(choice["text"].split()) == 1
    assert "A logits processor of a request raised" in served.log.read_text()
    served.assert_still_serving()


@pytest.mark.parametrize("token_id", [VOCAB_SIZE, VOCAB_SIZE + 1, -1, 10**6])
def test_prompt_ids_outside_the_vocabulary_are_refused(served, token_id):
    reply = served.post("/v1/completions",
                        completion(served, prompt=[13, token_id]))
    assert reply.status == 400, reply.text
    assert (f"Token id {token_id} is out of vocabulary: this model's token "
            f"ids are 0 to {VOCAB_SIZE - 1}") in reply.error_message
    served.assert_still_serving()


def test_last_id_of_the_vocabulary_is_served(served):
    reply = served.post("/v1/completions",
                        completion(served, prompt=[13, VOCAB_SIZE - 1]))
    assert reply.status == 200, reply.text


def test_lone_surrogate_is_refused_saying_what_is_wrong(served):
    for path, body in (
        ("/v1/completions", completion(served, prompt="the \ud800 cat")),
        ("/v1/chat/completions",
         chat(served, messages=[{
             "role": "user",
             "content": "the cat \udfff"
         }])),
    ):
        reply = served.post(path, body)
        assert reply.status == 400, reply.text
        assert "not valid Unicode" in reply.error_message
        assert "lone surrogate" in reply.error_message
        assert "TextEncodeInput" not in reply.error_message
    served.assert_still_serving()


def test_beam_search_is_refused_with_hooks_and_served_without(servers):
    for server in servers.values():
        for path, body in (
            ("/v1/completions",
             completion(server, use_beam_search=True, n=2, max_tokens=6)),
            ("/v1/completions",
             completion(server,
                        use_beam_search=True,
                        n=2,
                        max_tokens=6,
                        stream=True)),
            ("/v1/chat/completions",
             chat(server, use_beam_search=True, n=2, max_tokens=6)),
        ):
            reply = server.post(path, body)
            if server.hooked:
                assert reply.status == 400, reply.text
                assert "use_beam_search" in reply.error_message
                assert HOOKS_REFUSE in reply.error_message
            else:
                assert reply.status == 200, reply.text
        server.assert_still_serving()


def test_llm_beam_search_is_refused_on_a_hooked_engine(hooked_llm):
    with pytest.raises(ValueError, match="use_beam_search"):
        hooked_llm.beam_search([{
            "prompt": "the cat sees"
        }], BeamSearchParams(beam_width=2, max_tokens=4))


@dataclass(frozen=True)
class Case:
    """One request option (or a combination) sent to both servers."""
    # Fields added to the greedy base request.
    fields: dict
    # Chat API instead of completions.
    chat: bool = False
    # Expected status per server; 200 unless given.
    status: dict = field(default_factory=dict)
    # Text the error message must contain, per server, when refused.
    message: dict = field(default_factory=dict)
    # Request fields this case covers (the fields' keys if not given).
    covers: Optional[tuple] = None

    def expected(self, server: str) -> int:
        return self.status.get(server, 200)

    @classmethod
    def refused_by_hooked(cls, fields: dict, reason: str) -> "Case":
        """Refused by the hooked server only, its message containing
        ``reason``."""
        return cls(fields, status=HOOKED_REFUSES, message={"hooked": reason})

    @classmethod
    def refused_by_both(cls, fields: dict, reason: str, **kwargs) -> "Case":
        """Refused by both servers, each message containing ``reason``."""
        return cls(fields,
                   status=BOTH_REFUSE,
                   message={
                       "hooked": reason,
                       "stock": reason
                   },
                   **kwargs)


SAMPLED = {"temperature": 1.0, "seed": 7}
TOOL = {
    "type": "function",
    "function": {
        "name": "look",
        "description": "look at a thing",
        "parameters": {
            "type": "object",
            "properties": {
                "thing": {
                    "type": "string"
                }
            }
        }
    }
}
BOTH_REFUSE = {"hooked": 400, "stock": 400}
HOOKED_REFUSES = {"hooked": 400}
GUIDED_MESSAGE = {"hooked": "guided decoding"}
# The tiny vocabulary cannot begin JSON: refused on both servers.
NO_JSON = {"hooked": "guided decoding", "stock": "no token of this model"}


def tool_case(choice, **kwargs) -> Case:
    """A chat request offering `TOOL` with ``tool_choice`` ``choice``."""
    return Case({"tools": [TOOL], "tool_choice": choice}, chat=True, **kwargs)


def guided_cases() -> dict:
    """Every guided-decoding kind, with each backend vLLM 0.9.2 offers."""
    kinds = {
        "json": ({
            "guided_json": {
                "type": "object"
            }
        }, NO_JSON),
        "regex": ({
            "guided_regex": "(cat|dog)"
        }, GUIDED_MESSAGE),
        "choice": ({
            "guided_choice": ["cat", "dog"]
        }, GUIDED_MESSAGE),
        "grammar": ({
            "guided_grammar": 'root ::= "cat" | "dog"'
        }, GUIDED_MESSAGE),
        "json_object": ({
            "response_format": {
                "type": "json_object"
            }
        }, NO_JSON),
    }
    # What each backend does with the tiny vocabulary (stock server):
    # outlines cannot build JSON over it and reads EBNF as Lark, guidance
    # cannot convert a tokenizer without a decoder; lm-format-enforcer
    # ends the output where nothing is allowed (a 200).
    stock_refuses = {
        "xgrammar": {"json", "json_object"},
        "outlines": {"json", "grammar", "json_object"},
        "guidance": set(kinds),
        "lm-format-enforcer": set(),
        "auto": {"json", "json_object"},
    }
    cases = {}
    for backend, refused in stock_refuses.items():
        for kind, (fields, message) in kinds.items():
            status = {"hooked": 400}
            if kind in refused:
                status["stock"] = 400
            cases[f"{backend}-{kind}"] = Case(
                {
                    **fields, "guided_decoding_backend": backend
                },
                status=status,
                message={"hooked": message["hooked"]},
            )
    return cases


CASES = {
    **guided_cases(),
    "best_of":
    Case({
        "n": 1,
        "best_of": 3,
        **SAMPLED
    }),
    "n":
    Case({
        "n": 2,
        **SAMPLED
    }),
    "n-streamed":
    Case({
        "n": 2,
        "stream": True,
        **SAMPLED
    }),
    "echo":
    Case({"echo": True}),
    "echo-logprobs":
    Case({
        "echo": True,
        "logprobs": 2
    }),
    "penalties":
    Case({
        "frequency_penalty": 0.5,
        "presence_penalty": 0.5,
        "repetition_penalty": 1.2
    }),
    "logit_bias":
    Case({"logit_bias": {
        "13": 5.0,
        "20": -100
    }}),
    "logprobs":
    Case({"logprobs": 3}),
    "logprobs-too-many":
    Case({"logprobs": 30}, status=BOTH_REFUSE, message={"stock": "logprobs"}),
    "max_tokens-too-many":
    Case({"max_tokens": 10**6},
         status=BOTH_REFUSE,
         message={"stock": "maximum context length"}),
    "max_tokens-zero":
    Case({"max_tokens": 0}, status=BOTH_REFUSE),
    "seed":
    Case(SAMPLED),
    "sampling":
    Case({
        "top_p": 0.5,
        "top_k": 5,
        "min_p": 0.1,
        **SAMPLED
    }),
    "stop":
    Case({
        "stop": ["cat", "dog"],
        "include_stop_str_in_output": True
    }),
    "stop_token_ids":
    Case({"stop_token_ids": [13, 14]}),
    "stream":
    Case({
        "stream": True,
        "stream_options": {
            "include_usage": True,
            "continuous_usage_stats": True
        }
    }),
    "suffix":
    Case({"suffix": "the end"},
         status=BOTH_REFUSE,
         message={"stock": "suffix"}),
    "user":
    Case({"user": "someone"}),
    "beam":
    Case.refused_by_hooked(
        {
            "use_beam_search": True,
            "n": 2,
            "length_penalty": 0.5
        }, "use_beam_search"),
    "ignore_eos":
    Case({
        "ignore_eos": True,
        "max_tokens": 30
    }),
    "min_tokens":
    Case({"min_tokens": 20}),
    "special_tokens":
    Case({
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False
    }),
    "truncate_prompt_tokens":
    Case({"truncate_prompt_tokens": 2}),
    "allowed_token_ids":
    Case({"allowed_token_ids": [13, 14, 2]}),
    "prompt_logprobs":
    Case({"prompt_logprobs": 2}),
    "prompt_embeds":
    Case.refused_by_both({"prompt_embeds": "AAAA"}, "--enable-prompt-embeds"),
    "add_special_tokens":
    Case({"add_special_tokens": False}),
    "response_format-text":
    Case({"response_format": {
        "type": "text"
    }}),
    "response_format-json_schema":
    Case({
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "thing",
                "schema": {
                    "type": "object"
                }
            }
        }
    }),
    "guided_whitespace_pattern":
    Case.refused_by_hooked(
        {
            "guided_regex": "(cat|dog)",
            "guided_whitespace_pattern": " *"
        }, "guided decoding"),
    "priority":
    Case({"priority": 1}, status=BOTH_REFUSE, message={"stock": "priority"}),
    "logits_processors-not-allowed":
    Case({"logits_processors": ["os.system"]},
         status=BOTH_REFUSE,
         message={"stock": "Logits processor 'os.system' is not allowed"}),
    "return_tokens_as_token_ids":
    Case({
        "return_tokens_as_token_ids": True,
        "logprobs": 1
    }),
    "kv_transfer_params":
    Case({"kv_transfer_params": {
        "any": 1
    }}),
    "vllm_xargs":
    Case({"vllm_xargs": {
        "any": 1
    }}),
    "return_promise_tree":
    Case({
        "return_promise_tree": True,
        "logprobs": 1
    }),
    "return_promise_tree-streamed":
    Case({
        "return_promise_tree": True,
        "stream": True
    }),
    "return_promise_tree-chat":
    Case({"return_promise_tree": True}, chat=True),
    "prompt-ids":
    Case({"prompt": [13, 14, 15]}),
    "prompt-batch":
    Case({"prompt": ["the cat", "a dog"]}),
    "prompt-empty":
    Case({"prompt": ""}, status=BOTH_REFUSE),
    "model-unknown":
    Case({"model": "nobody"}, status={
        "hooked": 404,
        "stock": 404
    }),
    # The chat API's own fields.
    "chat":
    Case({}, chat=True, covers=("messages", )),
    "chat-streamed":
    Case({"stream": True}, chat=True),
    "chat-logprobs":
    Case({
        "logprobs": True,
        "top_logprobs": 3
    }, chat=True),
    "chat-echo":
    Case({"echo": True}, chat=True),
    "chat-template":
    Case(
        {
            "add_generation_prompt": False,
            "chat_template": "{% for m in messages %}{{ m['content'] }} "
            "{% endfor %}",
            "chat_template_kwargs": {
                "any": 1
            },
            "documents": [{
                "title": "t",
                "text": "the cat"
            }],
        },
        chat=True),
    "chat-continue":
    Case(
        {
            "messages": [{
                "role": "user",
                "content": "the cat"
            }, {
                "role": "assistant",
                "content": "sees a"
            }],
            "add_generation_prompt":
            False,
            "continue_final_message":
            True
        },
        chat=True),
    "chat-max_completion_tokens":
    Case({"max_completion_tokens": 30}, chat=True),
    "chat-bad_words":
    Case({"bad_words": ["cat", "dog"]}, chat=True),
    # V0 has no per-request prefix-cache salt: refused by name.
    "chat-cache_salt":
    Case.refused_by_both({"cache_salt": "salt"}, "cache_salt", chat=True),
    "chat-misc":
    Case(
        {
            "request_id": "mine",
            "mm_processor_kwargs": {},
            "parallel_tool_calls": False
        },
        chat=True),
    "chat-tools-none":
    tool_case("none"),
    "chat-tools-auto":
    tool_case("auto", status=BOTH_REFUSE, message={"stock": "auto"}),
    "chat-tools-required":
    tool_case("required", status=BOTH_REFUSE, message=GUIDED_MESSAGE),
    "chat-tools-named":
    tool_case({
        "type": "function",
        "function": {
            "name": "look"
        }
    },
              status=BOTH_REFUSE,
              message=GUIDED_MESSAGE),
    "chat-structural_tag":
    Case(
        {
            "response_format": {
                "type":
                "structural_tag",
                "structures": [{
                    "begin": "<a>",
                    "schema": {
                        "type": "object"
                    },
                    "end": "</a>"
                }],
                "triggers": ["<a>"]
            },
            "structural_tag": "x"
        },
        chat=True,
        status=BOTH_REFUSE,
        covers=("response_format", "structural_tag")),
    "chat-surrogate":
    Case.refused_by_both({"messages": [{
        "role": "user",
        "content": "\ud800"
    }]},
                         "lone surrogate",
                         chat=True),
    "surrogate":
    Case.refused_by_both({"prompt": "\udbff the"}, "lone surrogate"),
    "prompt-out-of-vocabulary":
    Case.refused_by_both({"prompt": [VOCAB_SIZE]}, "out of vocabulary"),
}


def test_the_sweep_covers_every_request_field():
    covered = {"model", "prompt", "max_tokens", "temperature"}
    for case in CASES.values():
        covered.update(case.covers or case.fields)
    missing = (set(CompletionRequest.model_fields)
               | set(ChatCompletionRequest.model_fields)) - covered
    assert not missing, f"request fields no sweep case sends: {missing}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_request_option_sweep(name, served):
    case = CASES[name]
    make = chat if case.chat else completion
    path = "/v1/chat/completions" if case.chat else "/v1/completions"
    reply = served.post(path, make(served, **case.fields))
    assert reply.status == case.expected(served.name), reply.text[:2000]
    if reply.status == 200:
        # A stream that starts with 200 must not carry an error.
        assert '"error"' not in reply.text[:100000], reply.text[:2000]
    if served.name in case.message:
        assert case.message[served.name] in reply.error_message
    served.assert_still_serving()


def test_offline_engine_survives_a_raising_logits_processor(hooked_llm):
    # The guard is in the engine: LLM.generate ends only that request.
    def raises(token_ids, logits):
        raise RuntimeError("a broken processor")

    broken, fine = hooked_llm.generate(["the cat sees", "the cat sees"], [
        SamplingParams(max_tokens=8, logits_processors=[raises]),
        SamplingParams(max_tokens=8, temperature=0.0)
    ],
                                       use_tqdm=False)
    assert broken.outputs[0].finish_reason == "stop"
    assert list(
        broken.outputs[0].token_ids) == [build_tokenizer().eos_token_id]
    assert len(fine.outputs[0].token_ids) == 8
