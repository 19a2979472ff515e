# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The real model (SmolLM2-135M-Instruct, fine-tuned here) on the hooked
engine: the protocol end to end with a BPE tokenizer and a chat template.

- Parallel requests over held-out countries promise one child per
  country, each child writes its own country's sentence, and the
  children finish and are merged (how often the capitals are right is
  the model card's business).
- A resumed parent continues exactly as a fresh request over the same full
  token context does (greedy): the merge's re-tokenized text and the KV
  cache it resumes on agree.
- Merged text and hook tokens never corrupt the detokenized output: with
  children made to write spaces, newlines and multi-byte characters, the
  parent's text is the decode of its token ids, and holds the children's
  texts verbatim.
- Chat completions over `vllm serve` apply the model's chat template: the
  served answer and tree equal the offline engine's for the same messages.
"""

import eval_real_model as evaluation
import pytest
import requests

from sequence_hooks_testkit.scripted_hooks import ScriptedHooks
from sequence_hooks_testkit.server import running_server
from sequence_hooks_training import capitals_task as task
from sequence_hooks_training import prepare_base_model as prepare
from vllm import SamplingParams

# One task per size 2..5: a handful of prompts in one batch.
TASKS = evaluation.held_out_tasks(4, seed=3000)
# Texts the scripted children write: leading, doubled and trailing
# spaces, newlines, accents, CJK and an emoji (multi-byte in UTF-8).
AWKWARD_TEXTS = [" Bogotá and  São Paulo\n", "東京 (Tōkyō)\n\n  ok 🙂 "]


@pytest.fixture(scope="module")
def real_llm():
    return evaluation.load(prepare.merge_delta())


@pytest.fixture(scope="module")
def parallel_outputs(real_llm):
    return real_llm.generate(
        [evaluation.chat_prompt(real_llm, task.messages_of(t)) for t in TASKS],
        SamplingParams(temperature=0.0, max_tokens=evaluation.MAX_TOKENS),
        use_tqdm=False)


def test_parallel_requests_run_their_trees_end_to_end(parallel_outputs):
    # The protocol, not the capitals (see the model card): every parallel
    # request promises one child per country (the committed delta does on
    # these tasks; its card has the rate over 168), each child answers for
    # its own country, and their texts are merged into the parent's.
    for t, output in zip(TASKS, parallel_outputs):
        tree = output.promise_tree
        assert tree is not None, output.outputs[0].text
        assert [(task.parse_sentence(c.text) or ("", ))[0]
                for c in tree.children] == list(t.countries)
        for child in tree.children:
            assert child.finish_reason in ("stop", "length")
            assert child.token_ids
        assert tree.num_merged_tokens > 0
        assert tree.token_ids == tuple(output.outputs[0].token_ids)


def test_resumed_parent_continues_as_a_fresh_request(real_llm,
                                                     parallel_outputs):
    sync_id = real_llm.get_tokenizer().convert_tokens_to_ids(task.SYNC)
    contexts, continuations = [], []
    for output in parallel_outputs:
        ids = list(output.outputs[0].token_ids)
        resume = (ids.index(sync_id) + 1 +
                  output.promise_tree.num_merged_tokens)
        contexts.append(
            {"prompt_token_ids": list(output.prompt_token_ids) + ids[:resume]})
        continuations.append(ids[resume:])
    fresh = real_llm.generate(contexts, [
        SamplingParams(temperature=0.0, max_tokens=len(c))
        for c in continuations
    ],
                              use_tqdm=False)
    assert [list(f.outputs[0].token_ids) for f in fresh] == continuations


def test_merged_text_and_hook_tokens_keep_the_text_intact(real_llm):
    tokenizer = real_llm.get_tokenizer()
    promise, sync, child = tokenizer.convert_tokens_to_ids(
        [task.PROMISE, task.SYNC, task.CHILD])
    eos = tokenizer.eos_token_id
    plans = {
        (): [promise, promise, sync] + [None] * 12,
        **{
            (i, ): tokenizer.encode(text, add_special_tokens=False)
            for i, text in enumerate(AWKWARD_TEXTS)
        }
    }
    output = real_llm.generate(
        evaluation.chat_prompt(real_llm, task.messages_of(TASKS[0])),
        SamplingParams(temperature=0.0,
                       max_tokens=64,
                       logits_processors=[
                           ScriptedHooks(plans, promise, child, eos,
                                         [promise, sync, child, eos])
                       ]),
        use_tqdm=False)[0]
    text, ids = output.outputs[0].text, output.outputs[0].token_ids
    assert [c.text for c in output.promise_tree.children] == AWKWARD_TEXTS
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert text.startswith("\n".join(AWKWARD_TEXTS))
    assert "\ufffd" not in text


def test_chat_over_the_server_answers_as_the_offline_engine(
        real_llm, parallel_outputs, tmp_path):
    messages = task.messages_of(TASKS[0])
    params = SamplingParams(temperature=0.0, max_tokens=evaluation.MAX_TOKENS)
    [chat] = real_llm.chat(messages, params, use_tqdm=False)
    # `LLM.chat` templates and tokenizes as the token-id prompt does.
    offline = parallel_outputs[0]
    assert chat.prompt_token_ids == offline.prompt_token_ids
    assert chat.outputs[0].text == offline.outputs[0].text
    model = prepare.merge_delta()
    with running_server(
            model,
            tmp_path / "server.log",
            extra=["--max-model-len",
                   str(evaluation.MAX_MODEL_LEN)]) as base:
        reply = requests.post(f"{base}/v1/chat/completions",
                              json={
                                  "model": str(model),
                                  "messages": messages,
                                  "temperature": 0.0,
                                  "max_tokens": evaluation.MAX_TOKENS,
                                  "return_promise_tree": True
                              },
                              timeout=300).json()
    [choice] = reply["choices"]
    assert choice["message"]["content"] == offline.outputs[0].text
    assert reply["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)
    served_children = choice["promise_tree"]["children"]
    assert [c["text"] for c in served_children
            ] == [c.text for c in offline.promise_tree.children]
