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
"""

import ast
from typing import Optional, TypedDict

# Every call's stop string; the controller writes CALLING in its place.
STOP = "<Sub Searches>"
CALLING = "<Calling Sub Searches>"
GOAL = "Goal Reached"


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
    return trace[:-1] if trace.split("\n")[-1] == "" else trace


def calls_sub_searches(trace: str) -> bool:
    """Whether the trace's last line ends a call of sub-searches."""
    return "<End Calling Sub Searches>" in trace.split("\n")[-1]


def _described_nodes(trace: str) -> dict[str, SubSearchNode]:
    """Every node the trace describes, by id: a "Moving to Node #id" line
    followed by its "Current State:" line, then every "Generated Node"
    line of an id not seen, its operations its parent's and its own."""
    nodes: dict[str, SubSearchNode] = {}
    lines = trace.split("\n")
    for i in range(len(lines) - 1):
        if "Moving to Node #" in lines[i] and "Current State:" in lines[i + 1]:
            node_id = lines[i].split("Moving to Node #")[1].strip()
            state = lines[i + 1].split("Current State:")[1].split("],")[0]
            state = state.strip()
            nodes[node_id] = SubSearchNode(
                node=f"#{node_id}",
                target=int(state.split(":")[0]),
                nums=ast.literal_eval(state.split(":")[1].strip() + "]"),
                operations=ast.literal_eval(
                    lines[i + 1].split("Operations:")[1].strip()))
    for line in lines:
        if "Generated Node" not in line:
            continue
        node_id = line.split(":")[0].split("#")[1]
        if node_id in nodes:
            continue
        rest = line.split(":", 1)[1].strip()
        state = rest.split("Operation:")[0].strip()
        operation = rest.split("Operation:")[1].strip()
        parent = nodes[",".join(node_id.split(",")[:-1])]
        nodes[node_id] = SubSearchNode(
            node=f"#{node_id}",
            target=int(state.split(":")[0]),
            nums=ast.literal_eval(state.split(":")[1].strip()),
            operations=parent["operations"] + [operation])
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
    section = trace.split(CALLING + "\n")[-1]
    section = section.split("\n<End Calling Sub Searches>")[0]
    listed = [
        nodes[line.split("Moving to Node #")[1].strip()]
        for line in section.split("\n")
        if "<Start Sub Search" in line and "Moving to Node" in line
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
    prefix = (CALLING + "\n").join(trace.split(CALLING + "\n")[:-1])
    prefix += "<Sub Searches>\n"
    for i, (node, result) in enumerate(zip(nodes, results)):
        if result is None:
            prefix += (f"<No Solution in Sub Search {i} at level 1 at Node "
                       f"{node['node']}>\n")
        else:
            prefix += (f"<Goal Reached in Sub Search {i} at level 1 at Node "
                       f"{node['node']}>\n" + result + "\n")
    return prefix + "<End Sub Searches>\n"
