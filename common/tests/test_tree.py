# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`PromiseNode.critical_path`: decoding steps on a tree's longest chain,
on trees written out by hand."""

from sequence_hooks.tree import PromiseNode


def node(num_tokens: int,
         children=(),
         merged_spans=(),
         fork_position=None) -> PromiseNode:
    return PromiseNode("n", 0, tuple(children), "", tuple(range(num_tokens)),
                       "stop", sum(count for _, count in merged_spans),
                       tuple(merged_spans), fork_position)


def test_a_tree_without_children_takes_a_step_per_token():
    assert node(7).critical_path == 7


def test_a_merge_waits_for_the_longest_child_and_takes_one_step():
    # Root: 3 tokens (promise at 2, promise at 3), a merge of 6 tokens at
    # 3, then 2 tokens. Children start after steps 2 and 3.
    short, long = node(2, fork_position=2), node(4, fork_position=3)
    root = node(11, [short, long], [(3, 6)])
    # The merge waits for the long child: 3 + 4, then its step, then 2.
    assert root.critical_path == 3 + 4 + 1 + 2


def test_a_merge_that_waits_for_nothing_takes_one_step():
    child = node(1, fork_position=1)
    root = node(10, [child], [(5, 2)])
    assert root.critical_path == 5 + 1 + 3


def test_nested_children_count_along_their_chain():
    grandchild = node(5, fork_position=1)
    child = node(2 + 5, [grandchild], [(1, 5)], fork_position=1)
    root = node(1 + 7, [child], [(1, 7)])
    # Child: its promise, the grandchild's 5, its merge, its last token.
    assert child.critical_path == 1 + 5 + 1 + 1
    # Root: its promise, the child's chain, its merge.
    assert root.critical_path == 1 + 8 + 1


def test_each_merge_waits_only_for_the_children_spawned_before_it():
    first, second = node(6, fork_position=1), node(1, fork_position=4)
    root = node(4 + 2, [first, second], [(1, 1), (4, 1)])
    # The first merge waits for `first` (steps 1 + 6, merged at 8); two
    # tokens (10); `second` ends at 11, merged at 12; the last token.
    assert root.critical_path == 13
