# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""APR's trace grammar, as its controller reads and writes traces: the
references' own, written from Parallel-Reasoning/APR and sharing no code
with the engine's lifecycle, so that a slip in either shows as a
difference between them.

From src/eval/eval_apr.py: `generated` (`generate`: the BOS sent as text,
replaced by a space in the trace), `decoded` (the end of `decode_trace`)
and `calls_sub_searches` (`is_calling_subsearch`). From
src/eval/parallel_infernce_utils.py: `sub_search_info`
(`get_subsearch_info`), `search_result` (`get_search_result`) and
`after_sub_searches` (`get_main_trace_after_sub_search`). Lists in a
trace are read with ``ast.literal_eval`` where the reference uses
``eval``.

The reference reads a trace with ``str.split``; here regular
expressions find its lines and fields (a field is the text after its tag
up to the tag's next occurrence, as ``split(tag)[1]`` is), in the
reference's order, so that a trace it cannot read raises here as there
(the same error, but for ``eval``'s).
"""

import ast
import re
from typing import Any, Optional, TypedDict

# Every call's stop string; the controller writes CALLING in its place.
STOP = "<Sub Searches>"
CALLING = "<Calling Sub Searches>"
CALL_ENDS = "<End Calling Sub Searches>"
GOAL = "Goal Reached"


def _up_to_next(tag: str, end: str = "") -> "re.Pattern[str]":
    """What follows ``tag`` up to its next occurrence (or ``end``, a
    pattern) or the string's end: the reference's ``text.split(tag)[1]``
    (then ``.split(end)[0]``)."""
    tag = re.escape(tag)
    stops = "|".join(filter(None, (end, tag, r"\Z")))
    return re.compile(f"{tag}(.*?)(?={stops})", re.S)


_NODE_ID = _up_to_next("Moving to Node #")
_STATE = _up_to_next("Current State:", r"\],")
_OPERATIONS = _up_to_next("Operations:")
_OPERATION = _up_to_next("Operation:")
# A line that moves to a node, where the next one shows its state (that
# line not consumed: it may move to a node too).
_MOVE = re.compile(
    r"^([^\n]*Moving to Node #[^\n]*)\n(?=([^\n]*Current State:[^\n]*))", re.M)
_GENERATED = re.compile(r"^[^\n]*Generated Node[^\n]*", re.M)
# A generated node's id: from the first "#" to the next "#" or colon,
# with no colon before it.
_GENERATED_ID = re.compile(r"\A[^:#]*#([^:#]*)")
# A line of a call that starts a sub-search from a node.
_LISTED = re.compile(
    r"^(?=[^\n]*<Start Sub Search)(?=[^\n]*Moving to Node)[^\n]*", re.M)


class SubSearchNode(TypedDict):
    """A node a sub-search starts from, as the reference's dict."""

    node: str
    target: int
    nums: list[int]
    operations: list[str]


def generated(bos_token: str, prefix: str, text: str) -> str:
    """The trace after a call: the BOS it was sent with, the prefix and
    the completion, every BOS replaced by a space and one leading space
    dropped. A tokenizer without BOS (the reference has none) sends and
    replaces nothing."""
    trace = bos_token + prefix + text
    if bos_token:
        trace = trace.replace(bos_token, " ")
    return trace[1:] if trace.startswith(" ") else trace


def decoded(trace: str) -> str:
    """A trace as `decode_trace` returns it: an empty last line dropped."""
    return trace.removesuffix("\n")


def calls_sub_searches(trace: str) -> bool:
    """Whether the trace's last line ends a call of sub-searches."""
    return CALL_ENDS in trace.rpartition("\n")[2]


# The reference's error where it indexes a split past its end.
_PAST_THE_END = "list index out of range"


def _found(pattern: "re.Pattern[str]", text: str) -> str:
    """``pattern``'s group in ``text``; where it is not (the reference's
    split finds no tag), the reference's IndexError."""
    match = pattern.search(text)
    if match is None:
        raise IndexError(_PAST_THE_END)
    return match[1]


def _target_and_nums(state: str, close: str) -> tuple[int, Any]:
    """A state "target:nums": the target before its first colon, and the
    numbers up to a second one, then ``close``, as a literal (IndexError
    with no colon, after the target is read)."""
    target, colon, rest = state.partition(":")
    number = int(target)
    if not colon:
        raise IndexError(_PAST_THE_END)
    return number, ast.literal_eval(rest.partition(":")[0].strip() + close)


def _described_nodes(trace: str) -> dict[str, SubSearchNode]:
    """Every node the trace describes, by id: each "Moving to Node #id"
    line whose next line shows its "Current State:", in order (a later
    one of an id replaces it), then each "Generated Node" line of an id
    not seen, its operations its parent's and its own. Raises on the
    first it cannot read."""
    nodes: dict[str, SubSearchNode] = {}
    for move in _MOVE.finditer(trace):
        node_id = _found(_NODE_ID, move[1]).strip()
        state = _found(_STATE, move[2]).strip()
        operations = _found(_OPERATIONS, move[2]).strip()
        target, nums = _target_and_nums(state, "]")
        nodes[node_id] = SubSearchNode(node="#" + node_id,
                                       target=target,
                                       nums=nums,
                                       operations=ast.literal_eval(operations))
    for line in _GENERATED.finditer(trace):
        node_id = _found(_GENERATED_ID, line[0])
        if node_id in nodes:
            continue
        _, colon, rest = line[0].partition(":")
        if not colon:
            raise IndexError(_PAST_THE_END)
        rest = rest.strip()
        operation = _found(_OPERATION, rest).strip()
        target, nums = _target_and_nums(
            rest.partition("Operation:")[0].strip(), "")
        parent_id, _, _ = node_id.rpartition(",")
        nodes[node_id] = SubSearchNode(
            node="#" + node_id,
            target=target,
            nums=nums,
            operations=nodes[parent_id]["operations"] + [operation])
    return nodes


def child_budget(budget: Optional[int], children: int,
                 avg_sub_call: bool) -> Optional[int]:
    """A sub-search's ``Token Budget``: ``budget``, or with
    ``avg_sub_call`` its share rounded up to a multiple of 512 (none
    without a budget)."""
    if not avg_sub_call or budget is None:
        return budget
    return int((budget / children - 1) // 512 + 1) * 512


def sub_search_prefix(node: SubSearchNode, budget: Optional[int]) -> str:
    """A sub-search's prompt (the BOS not included)."""
    prefix = (f"Moving to Node {node['node']}\nCurrent State: "
              f"{node['target']}:[{', '.join(map(str, node['nums']))}], "
              f"Operations: {node['operations']}")
    return prefix if budget is None else f"Token Budget: {budget} {prefix}"


def sub_search_info(trace: str,
                    budget: Optional[int] = None,
                    avg_sub_call: bool = False) -> tuple[list[str], list]:
    """The prompts and nodes of the sub-searches the trace's last call
    lists, in order.

    Raises:
        ValueError: The trace calls no sub-searches.
        KeyError, IndexError, ValueError, SyntaxError: A listed node the
            trace does not describe, or a state that does not parse.
        ZeroDivisionError: ``avg_sub_call`` with a budget and no node
            listed.
    """
    if not calls_sub_searches(trace):
        raise ValueError("the trace calls no sub-searches")
    nodes = _described_nodes(trace)
    call = trace.rpartition(CALLING + "\n")[2]
    call = call.partition("\n" + CALL_ENDS)[0]
    listed = [
        nodes[_found(_NODE_ID, line[0]).strip()]
        for line in _LISTED.finditer(call)
    ]
    budget = child_budget(budget, len(listed), avg_sub_call)
    return [sub_search_prefix(node, budget) for node in listed], listed


def search_result(trace: str) -> Optional[str]:
    """The winning path: the trace from its second-to-last "Goal
    Reached", stripped, less that phrase and the character after it; None
    with fewer than two."""
    starts = [i for i in range(len(trace)) if trace.startswith(GOAL, i)]
    if len(starts) < 2:
        return None
    return trace[starts[-2]:].strip()[13:]


def after_sub_searches(trace: str, nodes: list[SubSearchNode],
                       results: list[Optional[str]]) -> str:
    """The parent's next prefix: its trace cut back to before its last
    ``<Calling Sub Searches>\\n``, then each sub-search's result."""
    if not calls_sub_searches(trace):
        raise ValueError("the trace calls no sub-searches")
    where = "in Sub Search {} at level 1 at Node {}>\n"
    parts = [trace.rpartition(CALLING + "\n")[0], STOP + "\n"]
    for i, (node, result) in enumerate(zip(nodes, results)):
        if result is None:
            parts.append("<No Solution " + where.format(i, node["node"]))
        else:
            parts += ("<Goal Reached " + where.format(i, node["node"]), result,
                      "\n")
    return "".join(parts) + "<End Sub Searches>\n"
