# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What crosses the engine-core boundary for the hooks, engine-core side.

V1 runs the scheduler in the engine core (often its own process) and sends
`EngineCoreOutput`s to the frontend as msgpack. The hooks add two things to
them: a resumed parent's merged tokens, as new tokens of its request (with
logprob rows where asked), and a finished root's tree, as plain data in
its output's `kv_transfer_params`, the one free-form per-request field V1
carries (`outputs.promise_tree` rebuilds it in the frontend).

With `n > 1` the frontend runs one engine request per sample and gives the
request's output the `kv_transfer_params` of the last sample to finish, so
`SampleTrees` sends every finished sample's tree with each later
finishing sample. That needs a request's samples in one engine core:
under data parallelism the plugin's `data_parallel.SamplesOnOneEngine`
keeps them together, and a sample that arrives with no sibling on record
is logged (its siblings' trees cannot come with it).
"""

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from sequence_hooks.tree import PromiseNode
from vllm.v1.engine import (EngineCoreEvent, EngineCoreEventType,
                            EngineCoreOutput)
from vllm.v1.outputs import LogprobsLists
from vllm.v1.request import Request

# Key of the root's `kv_transfer_params` that carries the tree's snapshot
# (`PromiseNode.to_dict(top_logprobs=True)`).
TREE_KEY = "promise_tree"
# Key that replaces it on a sample of an `n > 1` request: the trees of the
# request's samples finished so far, by sample index (a string, as JSON
# keys are), each as under TREE_KEY.
SAMPLE_TREES_KEY = "promise_trees"
# Engine request id of a sample V1's frontend fans an `n > 1` request out
# to: "<index>_<the request's id>" (`ParentRequest.get_child_info`).
SAMPLE_ID = re.compile(r"(\d+)_(.+)", re.DOTALL)

# Under vLLM's logger, whose handler prints the line.
logger = logging.getLogger("vllm.sequence_hooks.transport")


def attach_tree(out: EngineCoreOutput, tree: PromiseNode) -> None:
    """Puts a finished root's tree into its output."""
    params = dict(out.kv_transfer_params or {})
    params[TREE_KEY] = tree.to_dict(top_logprobs=True)
    out.kv_transfer_params = params


def merged_rows(token_ids: list[int], width: int,
                logprob: float) -> LogprobsLists:
    """Logprob rows of tokens given, not sampled: every column names the
    token, with ``logprob`` (one entry per position, rank 1)."""
    return LogprobsLists(
        np.repeat(np.array(token_ids, dtype=np.int64)[:, None], width, axis=1),
        np.full((len(token_ids), width), logprob, dtype=np.float32),
        np.ones(len(token_ids), dtype=np.int64))


def append_merged_tokens(out: EngineCoreOutput, request: Request,
                         token_ids: list[int], logprob: float) -> None:
    """Sends merged tokens as new tokens of ``out``'s request, with logprob
    rows of ``logprob`` if it asked for logprobs.

    Args:
        out: The request's output of this step.
        request: The request.
        token_ids: The merged tokens.
        logprob: Each one's logprob, in every column of its row.
    """
    out.new_token_ids = list(out.new_token_ids) + token_ids
    if request.sampling_params.num_logprobs is None:
        return
    width = (1 if out.new_logprobs is None else
             out.new_logprobs.logprob_token_ids.shape[1])
    rows = merged_rows(token_ids, width, logprob)
    if out.new_logprobs is not None:
        rows = LogprobsLists(
            *(np.concatenate([old, new])
              for old, new in zip(out.new_logprobs[:3], rows[:3])))
    out.new_logprobs = rows


@dataclass
class _Samples:
    """The samples of one `n > 1` request this engine core runs."""

    # Request ids of its samples that have not finished.
    live: set[str] = field(default_factory=set)
    # Finished samples' trees (`PromiseNode.to_dict`), by sample index.
    trees: dict[str, dict[str, Any]] = field(default_factory=dict)


class SampleTrees:
    """The trees of `n > 1` requests' samples, sent with every later
    finishing sample's output.

    The frontend sends a request's samples one right after the other. In
    process they all arrive before the next step; with the engine core in
    its own process, the tree of a sample that finished before a sibling
    arrived (within its first steps) goes with its own output only.
    """

    def __init__(self) -> None:
        # By the request's id (the samples' common part).
        self._samples: dict[str, _Samples] = {}

    def __len__(self) -> int:
        """`n > 1` requests with samples live."""
        return len(self._samples)

    def added(self, request_id: str) -> None:
        """Notes a new engine request, a sample or not."""
        match = SAMPLE_ID.fullmatch(request_id)
        if match is None:
            return
        if match[1] != "0" and match[2] not in self._samples:
            # The frontend sends sample 0 first: its siblings run in
            # another engine core (data parallelism without the samples
            # middleware) or finished before this one arrived.
            logger.warning(
                "sample %s of request %s reached this engine core with "
                "none of its siblings: their trees will not come with "
                "its answer. Under data parallelism, serve with --middleware "
                "vllm_sequence_hooks.data_parallel.SamplesOnOneEngine or "
                "name the engine of n > 1 requests (X-data-parallel-rank, "
                "data_parallel_rank)", match[1], match[2])
        self._samples.setdefault(match[2], _Samples()).live.add(request_id)

    def carries_trees(self, request_id: str, has_tree: Any) -> bool:
        """Whether a sample's outputs carry trees: its request's samples
        have trees (``has_tree(request id)`` for the live ones)."""
        samples = self._of(request_id)
        return samples is not None and (bool(samples.trees) or any(
            has_tree(sample) for sample in samples.live))

    def finished(self, out: EngineCoreOutput) -> None:
        """A sample's final output takes its tree and its finished
        siblings' along (outputs reach the frontend in the order sent);
        the sample is forgotten with its request's records."""
        samples = self._of(out.request_id)
        if samples is None:
            return
        index = SAMPLE_ID.fullmatch(out.request_id)[1]
        params = dict(out.kv_transfer_params or {})
        tree = params.pop(TREE_KEY, None)
        if tree is not None:
            samples.trees[index] = tree
        if samples.trees:
            params[SAMPLE_TREES_KEY] = dict(samples.trees)
        out.kv_transfer_params = params or None

    def forget(self, request_id: str) -> None:
        """A sample has ended (any request id may be given); its request's
        samples go with the last."""
        samples = self._of(request_id)
        if samples is not None:
            samples.live.discard(request_id)
            if not samples.live:
                del self._samples[SAMPLE_ID.fullmatch(request_id)[2]]

    def _of(self, request_id: str) -> Optional[_Samples]:
        match = SAMPLE_ID.fullmatch(request_id)
        samples = None if match is None else self._samples.get(match[2])
        return (samples if samples is not None and request_id in samples.live
                else None)


def preemptions(child_out: EngineCoreOutput) -> list[EngineCoreEvent]:
    """A dropped child output's preemption events, which go out with its
    root's next output (`add_events`; every tree ends with one).

    A child's outputs never leave the engine core, nor would its events:
    the frontend counts `vllm:num_preemptions_total` from the `PREEMPTED`
    events of the outputs it receives, so a child preempted for blocks
    would go uncounted. Its other events (queued, scheduled) would set
    the root's own timestamps and stay behind.

    Args:
        child_out: The child's output of this step.

    Returns:
        Its `PREEMPTED` events.
    """
    return [
        event for event in child_out.events or ()
        if event.type == EngineCoreEventType.PREEMPTED
    ]


def add_events(out: EngineCoreOutput, events: list[EngineCoreEvent]) -> None:
    """Adds events (a root's children's preemptions) to an output."""
    out.events = list(out.events or ()) + events
