# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Everything the V1 engine keeps for the requests of its trees, in one
place: a record per request (`MemberRecord`), made by `Members.record`
and dropped by `Members.drop` alone, which also drops what the engine
keeps per request beside the trees (steps in flight, `n > 1` samples).
What the records take of a step's outputs (a child's preemptions, a held
root's prompt logprobs) is taken here too (`Members.shown`).

The lifecycle's own records (`sequence_hooks.lifecycle.Coordinator`) say
what a member is; these say what the engine holds for it: a detokenizer,
kept logprobs, a request waiting to be added, a fork not admitted yet.
"""

from collections.abc import ItemsView
from dataclasses import dataclass, field
from typing import Any, Optional

from vllm_sequence_hooks.member_logprobs import MemberLogprobs
from vllm_sequence_hooks.parking import ForkPoint
from vllm_sequence_hooks.restarts import StepsInFlight, held_prompt_logprobs
from vllm_sequence_hooks.stop_strings import StopStringCheck
from vllm_sequence_hooks.transport import SampleTrees, add_events, preemptions

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreEvent, EngineCoreOutput
from vllm.v1.request import Request


@dataclass
class MemberRecord:
    """What the engine keeps for one request of a tree: a member, or a
    sample of an `n > 1` request whose outputs carry its siblings' trees
    (its stop-string check only)."""

    # Its stop-string check (a child's, a tree-carrying root's or
    # sample's); None: not checked in the engine core.
    stop: Optional[StopStringCheck] = None
    # Its current call's sampled logprobs (a child's, a held root's);
    # None: none kept.
    logprobs: Optional[MemberLogprobs] = None
    # A root whose format makes calls anew: its request as it arrived,
    # whose parameters every call of its tree has.
    template: Optional[Request] = None
    # A root whose outputs are held until its tree's report gives them.
    holds_output: bool = False
    # Its call made anew, waiting for the old call's steps in flight.
    new_call: Optional[Request] = None
    # A held root's prompt logprobs (`new_prompt_logprobs_tensors`,
    # `prompt_token_id_logprobs`), given with its whole output.
    prompt_logprobs: Optional[tuple[Any, Any]] = None
    # A child not admitted yet: where its prefix hit comes from.
    fork: Optional[ForkPoint] = None
    # A parked parent whose KV blocks were freed (`KvParking.evict`).
    evicted: bool = False
    # A root's children's preemption events, held for its next output.
    preemptions: list[EngineCoreEvent] = field(default_factory=list)


class Members:
    """The engine's records of its trees' requests, by request id, and
    what it keeps per request beside them (`in_flight`, `sample_trees`),
    all dropped by `drop`."""

    def __init__(self) -> None:
        self._records: dict[str, MemberRecord] = {}
        # Per request, its steps in flight (a call made anew waits them).
        self.in_flight = StepsInFlight()
        # The samples of `n > 1` requests, by the request's common id.
        self.sample_trees = SampleTrees()

    def __len__(self) -> int:
        """Requests with a record."""
        return len(self._records)

    def get(self, request_id: str) -> Optional[MemberRecord]:
        """A request's record; None if it has none."""
        return self._records.get(request_id)

    def items(self) -> ItemsView[str, MemberRecord]:
        """Each request's id and record."""
        return self._records.items()

    def record(self, request_id: str) -> MemberRecord:
        """A request's record, made if it has none.

        Args:
            request_id: The request's id.

        Returns:
            Its record.
        """
        record = self._records.get(request_id)
        if record is None:
            record = self._records[request_id] = MemberRecord()
        return record

    def kept_logprobs(self, request_id: str) -> Optional[list]:
        """A member's current call's kept logprobs so far (the list kept:
        to read, not to keep); None if it keeps none."""
        record = self._records.get(request_id)
        return (None if record is None or record.logprobs is None else
                record.logprobs.entries)

    def landed(self, scheduler_output: SchedulerOutput) -> list[Request]:
        """A step's output is in: its requests' steps are not in flight.

        Args:
            scheduler_output: The step's scheduler output.

        Returns:
            The calls made anew that waited for those steps and wait no
            more, taken from their records, to start.
        """
        self.in_flight.landed(scheduler_output)
        calls = []
        for request_id, record in self._records.items():
            if record.new_call is not None and not self.in_flight[request_id]:
                calls.append(record.new_call)
                record.new_call = None
        return calls

    def shown(self, outputs: list[EngineCoreOutput],
              children: dict[str, str]) -> list[EngineCoreOutput]:
        """A step's outputs of one client the frontend gets: none of a
        child (its preemptions held in its root's record), none of a held
        root (what it carries of its prompt's logprobs kept).

        Args:
            outputs: The outputs.
            children: The step's children, each with its root's id.

        Returns:
            The outputs shown.
        """
        shown = []
        for out in outputs:
            if out.request_id in children:
                root = self._records.get(children[out.request_id])
                if root is not None:
                    root.preemptions += preemptions(out)
                continue
            record = self._records.get(out.request_id)
            if record is not None and record.holds_output:
                kept = held_prompt_logprobs(out)
                if kept is not None:
                    record.prompt_logprobs = kept
            else:
                shown.append(out)
        return shown

    def give_preemptions(self, out: EngineCoreOutput) -> None:
        """Adds the preemptions held for a root to its output."""
        record = self._records.get(out.request_id)
        if record is not None and record.preemptions:
            add_events(out, record.preemptions)
            record.preemptions = []

    def evicted(self) -> set[str]:
        """The parked parents whose KV blocks were freed."""
        return {
            request_id
            for request_id, record in self._records.items() if record.evicted
        }

    def drop(self, request_id: str) -> None:
        """Drops everything kept for a request that has ended: its record,
        its steps in flight, its place among its request's samples.

        Args:
            request_id: The request's id.
        """
        self._records.pop(request_id, None)
        self.in_flight.forget(request_id)
        self.sample_trees.forget(request_id)
