# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NPR under data parallelism: `vllm serve models/npr-toy --special-kwargs
'{"format": "npr"}' --data-parallel-size 2` (vLLM's internal load
balancer, two engine cores) answers as one engine core does.

Every held-out prompt goes out at once, unpinned, greedy, with logprobs:
vLLM's balancer spreads them, and each engine core finishes some (its
`vllm:request_success_total`). Each answer must be the offline engine's
(test_formats_splice_in_engine.py's `served_format`: one engine core,
the same block size): the same tokens and the same tree, path by path
with its label. It must also pass that module's checks against an
independent Hugging Face forward with the layout's 4-D mask and
positions, run on the served answers: every sampled token is that
forward's argmax; every node of the tree holds its own tokens and that
forward's logprob for each token it sampled. Once the load is done, no
engine core holds a request, a KV block, a live path or a parked parent
(a missing gauge fails), and the hooks' spawn counter, summed over the
engine cores, has counted every path of every tree.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import test_formats_splice_in_engine as splice
from test_v1_data_parallel import descendants, nothing_held, wait_idle

from sequence_hooks_testkit import v1_data_parallel as dp
from sequence_hooks_testkit.formats.toy_server import choices, toy_server
from sequence_hooks_testkit.v1_server import REQUEST_TIMEOUT_S, metric

FORMAT = "npr"
ENGINES = 2
# vLLM's counter of finished requests, one sample per engine core (its
# `engine` label) and finish reason.
FINISHED = "vllm:request_success_total"
# One answer's bound (all of them are in flight at once).
ANSWER_TIMEOUT_S = 300

# The offline answers and the reference model (the test's parametrization
# keeps the NPR toy's alone).
served_format = splice.served_format


@pytest.fixture(scope="module")
def served_two_engines(tmp_path_factory):
    """`vllm serve` of the NPR toy with the format in-engine and two
    engine cores, as the single-engine served test starts it otherwise
    (block size, window)."""
    flags = ("--special-kwargs", splice.special_kwargs(FORMAT), "--block-size",
             str(splice.BLOCK_SIZE), "--data-parallel-size", str(ENGINES))
    with toy_server(splice.MODELS[FORMAT],
                    tmp_path_factory.mktemp("npr-dp") / "server.log",
                    flags,
                    start_timeout_s=dp.START_TIMEOUT_S,
                    max_model_len=splice.MAX_MODEL_LEN) as url:
        yield url


def finished_by_engine(url: str) -> dict[str, float]:
    """The requests each engine core has finished, by its `engine` label
    (one read of /metrics).

    Raises:
        KeyError: `FINISHED` has no sample (read as 0, it would hide an
            engine core that got nothing).
    """
    counts = dp.by_engine(
        requests.get(url + "/metrics", timeout=REQUEST_TIMEOUT_S).text,
        FINISHED)
    if not counts:
        raise KeyError(f"not on /metrics: {FINISHED}")
    return counts


def path_logprobs(node: dict) -> dict:
    """A path's node as the API's tree gives it (`[token id, logprob,
    rank]` entries, the sampled token's first), with each token's own
    logprob alone, as the offline answers hold it (null for a merged
    token); its paths' too."""
    assert node["logprobs"] is not None, node["label"]
    logprobs = []
    for token, entry in zip(node["token_ids"], node["logprobs"], strict=True):
        assert entry is None or entry[0][0] == token
        logprobs.append(None if entry is None else entry[0][1])
    return {
        **node, "logprobs": logprobs,
        "children": [path_logprobs(child) for child in node["children"]]
    }


def labels(tree: dict) -> list:
    """Each path's label, nested as the tree nests them."""
    return [(child["label"], labels(child)) for child in tree["children"]]


def answer(url: str, model, prompt: list[int]) -> dict:
    """A greedy completion of ``prompt`` (token ids), unpinned: its token
    ids and its tree with logprobs, as the offline answers hold them
    (`outputs.promise_tree`: the root's are the choice's own, null for
    its merged tokens, which the choice gives 0.0)."""
    body = {
        "model": str(model),
        "prompt": prompt,
        "max_tokens": splice.MAX_MODEL_LEN - len(prompt),
        "temperature": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
    }
    [choice], whole = choices(url,
                              "/v1/completions",
                              body,
                              timeout=ANSWER_TIMEOUT_S)
    tree = (whole.get("kv_transfer_params") or {}).get("promise_tree")
    if tree is not None:
        own = choice["logprobs"]["token_logprobs"]
        merged = {
            at
            for start, count in tree["merged_spans"]
            for at in range(start, start + count)
        }
        assert [own[at] for at in sorted(merged)] == [0.0] * len(merged)
        tree = {
            **tree, "logprobs": [
                None if at in merged else logprob
                for at, logprob in enumerate(own)
            ],
            "children": [path_logprobs(child) for child in tree["children"]]
        }
    return {"token_ids": choice["token_ids"], "tree": tree}


@pytest.mark.parametrize("served_format", [FORMAT], indirect=True)
def test_two_engines_serve_npr_as_one_engine_does(served_format,
                                                  served_two_engines):
    name, model, tokenizer, reference, prompt_ids, offline = served_format
    url = served_two_engines
    finished_before = finished_by_engine(url)
    spawned_before = metric(url, "promises_spawned_total")
    with ThreadPoolExecutor(len(prompt_ids)) as pool:
        answers = list(
            pool.map(lambda prompt: answer(url, model, prompt), prompt_ids))
    held = wait_idle(url)
    finished = finished_by_engine(url)
    spawned = metric(url, "promises_spawned_total") - spawned_before

    # Both engine cores served: the counter counts the answers (the
    # paths are no requests of the API's).
    served_by = {
        engine: count - finished_before.get(engine, 0.0)
        for engine, count in finished.items()
    }
    assert sorted(served_by) == [str(rank) for rank in range(ENGINES)]
    assert sum(served_by.values()) == len(prompt_ids), served_by
    assert min(served_by.values()) >= 1, served_by
    # The offline engine's answers, trees included.
    for i, (got, want) in enumerate(zip(answers, offline, strict=True)):
        assert got["token_ids"] == want["token_ids"], i
        if want["tree"] is None:
            assert got["tree"] is None, i
            continue
        assert dp.shape(got["tree"]) == dp.shape(want["tree"]), i
        assert labels(got["tree"]) == labels(want["tree"]), i
    assert len(splice.forking(answers)) >= len(answers) // 2
    # The single-engine module's checks against the reference forward,
    # on the served answers.
    served = (name, model, tokenizer, reference, prompt_ids, answers)
    splice.assert_the_layouts_argmax(served)
    splice.assert_trees_carry_the_layouts_logprobs(served)
    # Nothing held in any engine core; every path counted as spawned.
    assert held == nothing_held(ENGINES)
    assert spawned == sum(
        descendants(got["tree"]) for got in answers if got["tree"])
