# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Recompute accounting: prefill tokens a fan-out costs beyond its prompt.

Read from the scheduler's own outputs (each scheduled group's
`token_chunk_size`, less the prefix-cache hits the block manager reports
for it), for the same fan-out run three ways side by side:

- hooks: the hooked engine with room to spare. A child's first step
  computes the parent's `<promise>` and its role marker on top of the
  parent's KV cache; a resume computes `<sync>` and the merged tokens.
- client join: the peer client (`sequence_hooks_references.client_join`) on
  a stock engine with prefix caching and the scheduling options hooks
  turn on, as APR/ThreadWeaver-style systems join on unmodified vLLM: the
  parent's request samples its own a tokens, promises and `<sync>` (where
  it stops); each `<promise>` sends at once a child request over the
  context so far and the role marker, as the hooked child i's context
  is; one continuation request goes out over the parent's context, its
  `<sync>` and the merged tokens. Its child and continuation requests are
  what it computes beyond the prompt. Cache hits are whole blocks only,
  so every request also recomputes its context's last, partial block.
- recompute preemption: the hooked engine on a KV cache that just holds
  one `max_model_len` sequence (or all prompts, if more), so the scheduler
  preempts: each preempted sequence (or evicted parked parent, or child
  that waited for a running slot) recomputes its whole context. How often
  that happens depends on the cache size chosen; the cost of each event
  does not.

Each workload is `copies` requests at once over distinct prompts of
`context` tokens: `a` tokens, k promises, sync, `n` tokens; children write
m tokens; the same scripted program on every side. The join's final texts
are compared with the hooks' (`join_same_texts`). Prints a table and
writes JSON.

Usage: .venv/bin/python benchmarks/recompute_accounting.py [--ks 2 4 8]
    [--context 192] [--m 32] [--copies 2] [--out recompute_accounting.json]
"""

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from typing import Optional

from sequence_hooks.special_kwargs import SpecialKwargs
from sequence_hooks_bench.runs import prepare, report, run_requests
from sequence_hooks_references.client_join import (EngineSender, JoinTask,
                                                   scripted_options)
from sequence_hooks_testkit.oracle import scripted
from sequence_hooks_testkit.schedule_recorder import ScheduleRecorder

BLOCK_SIZE = 16
PREFIX_TOKENS = 8  # a
SUFFIX_TOKENS = 8  # n
# The stock engine's options: the scheduling options hooks turn on, and
# prefix caching, as a real join user would.
STOCK_OPTIONS = {
    "enable_chunked_prefill": True,
    "disable_async_output_proc": True,
    "enable_prefix_caching": True,
}


@dataclass
class PrefillPhase:
    """One run of prefill chunks of a sequence, up to its first decode."""
    # "prompt", "child start", "resume" or "recompute".
    kind: str
    # The sequence group's request id.
    request_id: str
    # Tokens the scheduler scheduled (token_chunk_size summed).
    scheduled: int = 0
    # Of those, tokens not served by the prefix cache: the model's work.
    computed: int = 0


class PrefillRecorder:
    """Records every prefill phase the scheduler hands out.

    A phase starts at a sequence's first prefill chunk after a decode (or
    ever) and its kind follows from the scheduler's state then: a fresh
    top-level sequence is a prompt, a chunk from position 0 of a sequence
    that ran before (or of a child that never ran on its parent's blocks)
    is a recompute, a child's first chunk on shared blocks is a child
    start, any other is a resume.
    """

    def __init__(self, llm, top_level_ids: Optional[set]) -> None:
        """
        Args:
            llm: The `LLM` whose scheduler to record.
            top_level_ids: Request ids that are not children; None if no
                request is a child (a stock engine).
        """
        self.top_level_ids = top_level_ids
        self.phases: list[PrefillPhase] = []
        self._open: dict[int, PrefillPhase] = {}
        self._seen: set[int] = set()
        self.scheduler = llm.llm_engine.scheduler[0]
        ScheduleRecorder(self.scheduler, observe=self._record).start()

    def _record(self, outputs) -> None:
        block_manager = self.scheduler.block_manager
        for scheduled in outputs.scheduled_seq_groups:
            group = scheduled.seq_group
            seq = group.first_seq
            if not group.is_prefill():
                self._open.pop(seq.seq_id, None)
                self._seen.add(seq.seq_id)
                continue
            done = seq.data.get_num_computed_tokens()
            phase = self._open.get(seq.seq_id)
            if phase is None or done == 0:
                phase = PrefillPhase(self._kind(group, done), group.request_id)
                self._open[seq.seq_id] = phase
                self.phases.append(phase)
            cached = max(0, block_manager.get_num_cached_tokens(seq) - done)
            # A fully cached prefill still computes its last token.
            cached = min(cached, scheduled.token_chunk_size - 1)
            phase.scheduled += scheduled.token_chunk_size
            phase.computed += scheduled.token_chunk_size - cached
            self._seen.add(seq.seq_id)

    def _kind(self, group, done: int) -> str:
        seq_id = group.first_seq.seq_id
        if done == 0:
            top_level = (self.top_level_ids is None
                         or group.request_id in self.top_level_ids)
            fresh = top_level and seq_id not in self._seen
            return "prompt" if fresh else "recompute"
        return "resume" if seq_id in self._seen else "child start"

    def take(self, kind: str) -> list[PrefillPhase]:
        """Removes and returns the phases of one kind recorded so far.

        Args:
            kind: "prompt", "child start", "resume" or "recompute".

        Returns:
            Those phases, in the order they started.
        """
        taken = [p for p in self.phases if p.kind == kind]
        self.phases = [p for p in self.phases if p.kind != kind]
        return taken

    def clear(self) -> None:
        """Forgets the phases recorded so far."""
        self.phases.clear()


def mean(phases: list[PrefillPhase], attr: str = "computed") -> float:
    """The mean of ``attr`` over ``phases``, 0 if there are none."""
    if not phases:
        return 0
    return round(statistics.mean(getattr(p, attr) for p in phases), 1)


def total(phases: list[PrefillPhase]) -> int:
    """Tokens computed over ``phases``."""
    return sum(p.computed for p in phases)


def fan_out(llm, recorder: PrefillRecorder, prompts, params, k: int):
    """Runs the hooked fan-out over ``prompts`` (one request each).

    Args:
        llm: A hooked `LLM`.
        recorder: The recorder of ``llm``'s scheduler; cleared first.
        prompts: Token ids of each request's prompt.
        params: The scripted program's sampling parameters.
        k: Children the program promises; checked.

    Returns:
        The mean number of merged tokens per request, the scheduler's
        preemptions during the run and each request's final text.
    """
    scheduler = llm.llm_engine.scheduler[0]
    recorder.clear()
    before = scheduler.num_cumulative_preemption
    outputs = run_requests(llm, [(f"fan-{c}", {
        "prompt_token_ids": prompt
    }, params) for c, prompt in enumerate(prompts)])
    assert all(len(o.promise_tree.children) == k for o in outputs.values())
    merged = statistics.mean(o.promise_tree.num_merged_tokens
                             for o in outputs.values())
    texts = [outputs[f"fan-{c}"].outputs[0].text for c in range(len(prompts))]
    return merged, scheduler.num_cumulative_preemption - before, texts


class LabellingSender(EngineSender):
    """An `EngineSender` that labels each request the join sends by
    its prompt: the parent's first request, a child's (its prompt ends
    with the role marker) or the parent's continuation (its prompt holds
    the `<sync>`).

    Args:
        engine: A stock `LLMEngine`.
        ids: The tiny tokenizer's hook token ids.
    """

    def __init__(self, engine, ids):
        super().__init__(engine, {"temperature": 0.0})
        self.ids = ids
        # Request id -> "parent", "child" or "continuation".
        self.labels: dict[str, str] = {}

    def submit(self, request) -> None:
        prompt = request.prompt_ids
        if prompt[-1] == self.ids.child:
            label = "child"
        elif self.ids.sync in prompt:
            label = "continuation"
        else:
            label = "parent"
        self.labels[request.request_id] = label
        super().submit(request)


def client_join(llm, recorder: PrefillRecorder, prompts, plans,
                max_tokens: int, ids, k: int):
    """Runs the program as the client-side join does, one join per
    prompt, all at once, on a stock engine with prefix caching.

    Args:
        llm: A stock `LLM` with prefix caching.
        recorder: The recorder of ``llm``'s scheduler.
        prompts: Token ids of each request's prompt.
        plans: The scripted program (see `ScriptedHooks`).
        max_tokens: Each request's budget.
        ids: The tiny tokenizer's hook token ids.
        k: Children the program promises; checked.

    Returns:
        The prefill phases of the child requests and of the continuation
        requests, and each join's final text.
    """
    # The cache must not hold an earlier run's (identical greedy) blocks.
    assert llm.reset_prefix_cache()
    recorder.clear()
    engine = llm.llm_engine
    sender = LabellingSender(engine, ids)
    special_kwargs = SpecialKwargs(sync_token_id=ids.sync,
                                   promise_token_id=ids.promise,
                                   child_role_token_id=ids.child)
    tasks = [
        JoinTask(f"join-{k}-{c}", prompt, max_tokens,
                 special_kwargs, engine.model_config.max_model_len,
                 engine.get_tokenizer(), sender, scripted_options(plans, ids))
        for c, prompt in enumerate(prompts)
    ]
    sender.run(tasks)
    assert all(len(task.result.promise_tree.children) == k for task in tasks)
    phases = recorder.take("prompt")
    assert not recorder.phases, "a join request restarted from position 0"

    def labelled(label: str) -> list[PrefillPhase]:
        return [p for p in phases if sender.labels[p.request_id] == label]

    return (labelled("child"), labelled("continuation"),
            [task.result.text for task in tasks])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--m", type=int, default=32)
    parser.add_argument("--copies", type=int, default=2)
    parser.add_argument("--out", default="recompute_accounting.json")
    args = parser.parse_args()
    a, n, m = PREFIX_TOKENS, SUFFIX_TOKENS, args.m
    # Merged text re-tokenizes to about m tokens per child plus separators.
    max_len = args.context + a + max(args.ks) * (m + 4) + n + 32
    ids, tokenizer, model = prepare(max_positions=max_len)
    from sequence_hooks_testkit.engines import tiny_llm
    from vllm import SamplingParams

    common = dict(max_model_len=max_len, block_size=BLOCK_SIZE)
    hooked = tiny_llm(model, ids, **common)
    stock = tiny_llm(model, **STOCK_OPTIONS, **common)
    # The least vLLM accepts (one max_model_len sequence), but room for
    # every prompt at once, so that the requests run together and grow
    # into preemptions instead of waiting for each other.
    tight_blocks = max(
        math.ceil(max_len / BLOCK_SIZE),
        args.copies * (math.ceil(args.context / BLOCK_SIZE) + 1))
    tight = tiny_llm(model,
                     ids,
                     num_gpu_blocks_override=tight_blocks,
                     **common)
    # Word ids follow the special tokens; each copy its own sequence.
    words = range(ids.child + 1, len(tokenizer))
    prompts = [[words[(c * 5 + i) % len(words)] for i in range(args.context)]
               for c in range(args.copies)]
    top_level = {f"fan-{c}" for c in range(args.copies)}
    hooked_phases = PrefillRecorder(hooked, top_level)
    tight_phases = PrefillRecorder(tight, top_level)
    stock_phases = PrefillRecorder(stock, None)

    rows = []
    for k in args.ks:
        plans = {(): [None] * a + [ids.promise] * k + [ids.sync] + [None] * n}
        for child in range(k):
            plans[(child, )] = [None] * m
        max_tokens = max_len - args.context
        params = SamplingParams(temperature=0.0,
                                max_tokens=max_tokens,
                                logits_processors=[scripted(plans, ids)])

        merged, _, texts = fan_out(hooked, hooked_phases, prompts, params, k)
        starts = hooked_phases.take("child start")
        resumes = hooked_phases.take("resume")
        assert len(starts) == k * args.copies == len(resumes) * k
        assert not hooked_phases.take("recompute"), (
            "a sequence of the roomy run restarted from position 0")

        _, preemptions, _ = fan_out(tight, tight_phases, prompts, params, k)
        recomputes = tight_phases.take("recompute")
        assert recomputes, "the small cache forced no recompute"
        parents = [p for p in recomputes if p.request_id in top_level]
        children = [p for p in recomputes if p.request_id not in top_level]
        tight_extra = (recomputes + tight_phases.take("child start") +
                       tight_phases.take("resume"))

        join_children, join_merges, join_texts = client_join(
            stock, stock_phases, prompts, plans, max_tokens, ids, k)
        same = sum(a == b for a, b in zip(texts, join_texts))
        row = dict(k=k,
                   context=args.context,
                   merged_tokens=merged,
                   join_same_texts=f"{same}/{args.copies}")
        # Per child start, per resume, per join request, per recompute.
        row.update(hooks_child_start=mean(starts),
                   join_child_scheduled=mean(join_children, "scheduled"),
                   join_child_computed=mean(join_children),
                   hooks_resume=mean(resumes),
                   join_merge_scheduled=mean(join_merges, "scheduled"),
                   join_merge_computed=mean(join_merges),
                   preemptions=preemptions,
                   recomputed_children=len(children),
                   per_child_recompute=mean(children),
                   recomputed_parents=len(parents),
                   per_parent_recompute=mean(parents))
        # Computed beyond the prompts, whole workload.
        row.update(hooks_total=total(starts) + total(resumes),
                   join_total=total(join_children) + total(join_merges),
                   preempted_total=total(tight_extra))
        rows.append(row)
        print(json.dumps(row), flush=True)
    report(rows, args.out)


if __name__ == "__main__":
    main()
