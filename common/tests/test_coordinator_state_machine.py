# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Random programs of engine events: the coordinator against the contract.

Hypothesis drives `FakeEngine` (the coordinator behind it) and
`ReferenceEngine` (the contract written plainly) with the same events:
requests arrive with random parameters, members sample ordinary and hook
tokens, finish now or later (a finish the engine has not reported yet),
requests are aborted. After every event both must agree on what the
engine holds (each live member's tokens, which are parked), on every fork
(id, parent, seed, budget, minimum, stop strings), every resume's seed,
every abort and every reported tree (texts, tokens, merge spans,
logprobs), and on the coordinator's queries and gauges. After every event
the ordering policy (`sequence_hooks.ordering`) orders the members an
engine would queue as the contract says: critical-path work and overdue
requests by their root's arrival, then new requests in the engine's
order, each counted once a step while behind critical-path work. At the
end every member is run to its finish: nothing may stay parked, tracked or
counted.
"""

from fake_engine import OFFSET, PROMISE, SYNC, FakeEngine
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant,
                                 precondition, rule)
from reference import ReferenceEngine

from sequence_hooks.actions import RequestParams
from sequence_hooks.ordering import CriticalPathOrder, Queued

# Steps a new member may be passed over, small so that programs pass it.
BOUND = 2

# Hook tokens as often as ordinary ones, so trees grow and join.
TOKENS = [PROMISE, SYNC, OFFSET + ord("a"), OFFSET + ord("b")]


def arrival(member_id: str) -> int:
    """A member's arrival: its root request's number."""
    return int(member_id.split("/")[0].split("-")[1])


class CoordinatorMachine(RuleBasedStateMachine):
    """One fake engine and the reference, fed the same events."""

    @initialize(per_sequence=st.integers(1, 3),
                per_request=st.integers(1, 5),
                depth=st.integers(1, 3),
                max_model_len=st.integers(12, 48),
                reseeds=st.booleans(),
                show_hooks=st.booleans())
    def start(self, per_sequence, per_request, depth, max_model_len, reseeds,
              show_hooks):
        limits = {
            "max_children_per_sequence": per_sequence,
            "max_children_per_request": per_request,
            "max_depth": depth,
        }
        self.engine = FakeEngine(limits, max_model_len, reseeds, show_hooks)
        self.reference = ReferenceEngine(limits, max_model_len, reseeds)
        self.order = CriticalPathOrder(self.engine.coordinator, BOUND, False)
        # The priority rule, on an engine that does not order by it.
        self.by_priority = CriticalPathOrder(self.engine.coordinator,
                                             BOUND,
                                             True,
                                             every_step=True)
        self.num_requests = 0
        self.add_request(2, None, 0, None, (), False)

    # Events.

    @precondition(lambda self: len(self.reference.live()) < 12)
    @rule(prompt_len=st.integers(1, 4),
          max_tokens=st.none() | st.integers(2, 30),
          min_tokens=st.integers(0, 3),
          seed=st.none() | st.integers(0, 2**32),
          stop=st.sampled_from([(), ("ab", )]),
          logprobs=st.booleans())
    def add_request(self, prompt_len, max_tokens, min_tokens, seed, stop,
                    logprobs):
        request_id = f"req-{self.num_requests}"
        self.num_requests += 1
        prompt = [OFFSET + ord("p")] * prompt_len
        params = RequestParams(prompt_len, max_tokens, min_tokens, seed, stop)
        for engine in (self.engine, self.reference):
            engine.add_request(request_id, prompt, params, logprobs)

    @rule(pick=st.integers(0, 99),
          tokens=st.lists(st.sampled_from(TOKENS), min_size=1, max_size=6))
    def sample(self, pick, tokens):
        """One member samples a few tokens, one engine step each."""
        for token in tokens:
            candidates = [
                member_id for member_id in self.reference.runnable()
                if self.reference.has_room(member_id)
            ]
            if not candidates:
                return
            member_id = candidates[pick % len(candidates)]
            self.engine.sample(member_id, token)
            self.reference.sample(member_id, token)
            self.engines_agree()

    @rule(pick=st.integers(0, 99),
          reason=st.sampled_from(["stop", "length"]),
          report_now=st.booleans())
    def finish(self, pick, reason, report_now):
        candidates = self.reference.runnable()
        if candidates:
            member_id = candidates[pick % len(candidates)]
            self._finish(member_id, reason, report_now)

    @rule(pick=st.integers(0, 99))
    def report(self, pick):
        stopped = sorted(i for i in self.reference.live()
                         if self.reference.nodes[i].stopped is not None)
        if stopped:
            self._report(stopped[pick % len(stopped)])

    @rule(pick=st.integers(0, 99))
    def abort_request(self, pick):
        roots = sorted(i for i in self.reference.live()
                       if self.reference.nodes[i].parent is None
                       and self.reference.nodes[i].stopped is None)
        if roots:
            root = roots[pick % len(roots)]
            self.engine.abort_request(root)
            self.reference.abort_request(root)

    def _finish(self, member_id, reason, report_now):
        self.engine.stop(member_id, reason)
        self.reference.stop(member_id, reason)
        if report_now:
            self._report(member_id)

    def _report(self, member_id):
        self.engine.report(member_id)
        self.reference.report(member_id)

    # Agreement.

    @invariant()
    def engines_agree(self):
        engine, reference = self.engine, self.reference
        assert engine.live() == reference.live()
        for member_id in engine.live():
            assert (engine.members[member_id].tokens ==
                    reference.nodes[member_id].tokens), member_id
        parked = {i for i, m in engine.members.items() if m.parked}
        assert parked == reference.parked()
        assert engine.forks == reference.forks
        assert [(i, r.seed)
                for i, r in engine.resumes] == reference.resume_seeds
        assert engine.aborts == reference.aborts
        assert {
            root: tree.to_dict()
            for root, tree in engine.reports.items()
        } == reference.reports

    @invariant()
    def queries_and_gauges_agree(self):
        coordinator, reference = self.engine.coordinator, self.reference
        for member_id in self.engine.live():
            node = reference.nodes[member_id]
            if node.request.done:
                # A finish the engine has yet to report, of an ended tree
                # (the engine decides its visibility with the tree).
                continue
            assert coordinator.is_child(member_id) == (node.parent is not None)
            assert (member_id
                    in coordinator.parked_members()) == (node.parked_length
                                                         is not None)
            assert (coordinator.on_critical_path(member_id) ==
                    reference.on_critical_path(member_id)), member_id
        assert coordinator.num_parked() == len(reference.parked())
        assert coordinator.num_members() == len(reference.live_tree_nodes())
        metrics = self.engine.metrics
        assert metrics.parents_parked.value == len(reference.parked())
        assert metrics.children_running.value == reference.children_running()
        assert metrics.promises_spawned.value == reference.spawned()
        assert metrics.promises_refused.value == reference.refused()

    @invariant()
    def queues_are_ordered_by_the_contract(self):
        """The members an engine would queue (in the order it keeps them,
        here by id), as the policy orders them, against the rule written
        out; a request's arrival is its number, a member's its root's."""
        reference = self.reference
        queue = sorted(reference.runnable())
        owed = dict(self.order.steps_passed_over)
        if not self.order.begin_step(lambda: queue):
            assert not any(map(reference.on_critical_path, queue))
            return
        entries = [Queued(i, 0, float(arrival(i))) for i in queue]
        # Both schedulers order their running queue first (nothing
        # counted), then the waiting one.
        running = self.order.running(entries, lambda queued: queued)
        waiting = self.order.waiting(entries, lambda queued: queued)
        critical = [i for i in queue if reference.on_critical_path(i)]
        first = [i for i in queue if i in critical or owed.get(i, 0) >= BOUND]
        new = [i for i in queue if i not in first]
        for ordered in (running, waiting):
            assert [q.request_id
                    for q in ordered] == sorted(first, key=arrival) + new
        assert self.order.steps_passed_over == {
            i: owed.get(i, 0) + (1 if i in new and critical else 0)
            for i in queue if owed.get(i, 0) or (i in new and critical)
        }

    @invariant()
    def under_priority_the_queues_are_ordered_by_priority_then_arrival(self):
        """The priority rule against the rule written out, every step,
        tree or not: a request's priority is its number modulo 3, a
        member's its root's; nothing is counted as passed over."""
        queue = sorted(self.reference.runnable())
        assert self.by_priority.begin_step(lambda: queue)
        expected = sorted(queue, key=lambda i: (arrival(i) % 3, arrival(i)))
        entries = [Queued(i, arrival(i) % 3, float(arrival(i))) for i in queue]
        for ordered in (self.by_priority.waiting(entries, lambda q: q),
                        self.by_priority.running(entries, lambda q: q)):
            assert [q.request_id for q in ordered] == expected
        assert self.by_priority.steps_passed_over == {}

    def teardown(self):
        """Runs every member to its finish: nothing stays behind."""
        if not hasattr(self, "engine"):
            return
        while self.reference.live():
            runnable = self.reference.runnable()
            stopped = [
                i for i in self.reference.live()
                if self.reference.nodes[i].stopped is not None
            ]
            if stopped:
                self._report(sorted(stopped)[0])
            else:
                # Deepest first: a parked member's children run first.
                assert runnable, "parked members with nothing to wait for"
                member_id = max(runnable,
                                key=lambda i: self.reference.nodes[i].depth)
                self._finish(member_id, "stop", True)
            self.engines_agree()
            self.queries_and_gauges_agree()
        engine = self.engine
        # What the program reached (pytest --hypothesis-show-statistics).
        event(f"children forked: {min(len(engine.forks), 5)}+")
        event(f"merges: {min(len(engine.resumes), 3)}+")
        event(f"abort cascades: {min(len(engine.aborts), 2)}+")
        event("grandchildren: "
              f"{any('/' in spec.parent_id for spec in engine.forks)}")
        coordinator = self.engine.coordinator
        assert coordinator.num_members() == 0
        assert coordinator.num_parked() == 0
        assert self.engine.metrics.children_running.value == 0
        assert self.engine.metrics.parents_parked.value == 0


CoordinatorMachine.TestCase.settings = settings(max_examples=1500,
                                                stateful_step_count=40,
                                                deadline=None)
TestCoordinatorAgainstTheContract = CoordinatorMachine.TestCase
