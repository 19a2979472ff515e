# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The priority rule's case, one for both engines: each suite plays it on
its engine's real scheduler (V0: `mytests/engine/test_critical_path_
scheduling.py`, V1: `v1/tests/test_v1_critical_path.py`) and checks the
same order (`sequence_hooks.ordering`: under `--scheduling-policy
priority`, the user's priority first, then arrival, a tree's work
carrying its root's).

Two slots (`max_num_seqs` = 2), both taken by "parent" and "busy"
(priority 1). The requests of `ARRIVALS` arrive; "parent" promises once
(its child is `CHILD`) and parks at its `<sync>`, which frees a slot.

The plain case: the same arrivals while "parent" never promises. With no
tree, `critical_path_first` on or off, they wait in `PLAIN_WAITING`'s
order (V0's chunked-prefill scheduler ignores the policy on its own).
"""

# (request id, priority, arrival time less the parent's), in the order the
# engine gets them.
ARRIVALS = [("same", 1, 1.0), ("urgent", 0, 2.0), ("early", 1, -1.0),
            ("low", 2, -2.0)]
PRIORITY = 1
CHILD = "parent/promise-0"
# The freed slot's taker, then the waiting requests in the order they are
# admitted: "early" arrived before the parent, "same" after it.
ADMITTED = "urgent"
WAITING = ["early", CHILD, "same", "low"]
# The plain case's waiting queue, in the order it is admitted.
PLAIN_WAITING = ["urgent", "early", "same", "low"]
