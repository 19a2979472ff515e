# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""APR's controller: its sub-search calls, run as a client of stock vLLM.

The reference is Parallel-Reasoning/APR, src/eval/eval_apr.py
(`call_search`, `decode_trace`, `generate`) and
src/eval/parallel_infernce_utils.py (`get_subsearch_info`,
`get_search_result`, `get_main_trace_after_sub_search`): text in, text
out; its algorithm, written anew, is in docs/formats.md. Lists in the
trace are read with ``ast.literal_eval`` where the reference uses
``eval``.
"""

import ast
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from sequence_hooks_testkit.formats.driver import Calls, drive, together

CALL, CALL_END = "<Calling Sub Searches>\n", "<End Calling Sub Searches>"
# Never the model's to write: the controller writes CALLING for it.
SUB_SEARCHES, CALLING = "<Sub Searches>", "<Calling Sub Searches>"
GOAL = "Goal Reached"


@dataclass(frozen=True)
class TextCompletion:
    """One call's text (a matched stop string left out), vLLM's finish
    reason and the stop string or id it matched (None if none)."""
    text: str
    finish_reason: str
    stop_reason: Any


class TextBackend(Protocol):
    """Decodes text prompts on stock vLLM."""

    def generate_text(self, prompts: list[str],
                      params: list[dict[str, Any]]) -> list[TextCompletion]:
        """Decodes each prompt with its sampling parameters, at once."""
        ...


@dataclass(frozen=True)
class Node:
    """A search node a sub-search starts from."""
    node: str
    target: int
    nums: list[int]
    operations: list[str]

    def prefix(self, budget: Optional[int]) -> str:
        """The child's prompt."""
        text = (f"Moving to Node {self.node}\nCurrent State: {self.target}:"
                f"[{', '.join(map(str, self.nums))}], Operations: "
                f"{self.operations}")
        return text if budget is None else f"Token Budget: {budget} {text}"


def calls_sub_searches(trace: str) -> bool:
    """Whether the trace's last line ends a call of sub-searches."""
    return CALL_END in trace.split("\n")[-1]


def _nodes(trace: str) -> dict[str, Node]:
    """Every node the trace describes, by id."""
    nodes: dict[str, Node] = {}
    lines = trace.split("\n")
    for line, following in zip(lines, lines[1:]):
        if "Moving to Node #" in line and "Current State:" in following:
            node_id = line.split("Moving to Node #")[1].strip()
            state = following.split("Current State:")[1].split("],")[0]
            target, nums = state.strip().split(":", 1)
            nodes[node_id] = Node(
                f"#{node_id}", int(target),
                ast.literal_eval(nums.strip() + "]"),
                ast.literal_eval(following.split("Operations:")[1].strip()))
    for line in lines:
        if "Generated Node" not in line:
            continue
        node_id = line.split(":")[0].split("#")[1]
        if node_id in nodes:
            continue
        rest = line.split(":", 1)[1].strip()
        state, operation = (part.strip()
                            for part in rest.split("Operation:")[:2])
        target, nums = state.split(":", 1)
        parent = nodes[",".join(node_id.split(",")[:-1])]
        nodes[node_id] = Node(f"#{node_id}", int(target),
                              ast.literal_eval(nums.strip()),
                              parent.operations + [operation])
    return nodes


def sub_searches(trace: str) -> list[Node]:
    """The nodes the trace's last call lists, in order (the reference's
    `get_subsearch_info`).

    Raises:
        ValueError: the trace calls no sub-searches.
        KeyError, IndexError, ValueError, SyntaxError: a listed node the
            trace does not describe, or a malformed state.
    """
    if not calls_sub_searches(trace):
        raise ValueError("the trace calls no sub-searches")
    nodes = _nodes(trace)
    section = trace.split(CALL)[-1].split("\n" + CALL_END)[0]
    return [
        nodes[line.split("Moving to Node #")[1].strip()]
        for line in section.split("\n")
        if "<Start Sub Search" in line and "Moving to Node" in line
    ]


def child_budget(budget: Optional[int], children: int,
                 avg_sub_call: bool) -> Optional[int]:
    """A child's ``Token Budget``: the whole, or with ``avg_sub_call`` its
    share rounded up to a multiple of 512."""
    if not avg_sub_call or budget is None:
        return budget
    return int((budget / children - 1) // 512 + 1) * 512


def search_result(trace: str) -> Optional[str]:
    """The winning path of a trace that reached the goal, else None."""
    if trace.count(GOAL) < 2:
        return None
    return trace[trace[:trace.rfind(GOAL)].rfind(GOAL):].strip()[13:]


def joined_trace(trace: str, nodes: list[Node],
                 results: list[Optional[str]]) -> str:
    """The parent cut back to before its last call, then the children's
    results (the reference's `get_main_trace_after_sub_search`)."""
    joined = CALL.join(trace.split(CALL)[:-1]) + "<Sub Searches>\n"
    for i, (node, result) in enumerate(zip(nodes, results)):
        if result is None:
            joined += (f"<No Solution in Sub Search {i} at level 1 at Node "
                       f"{node.node}>\n")
        else:
            joined += (f"<Goal Reached in Sub Search {i} at level 1 at Node "
                       f"{node.node}>\n{result}\n")
    return joined + "<End Sub Searches>\n"


@dataclass
class APRRollout:
    """One search: the parent's final trace, its answer and its calls."""
    trace: str = ""
    # The final trace's winning path, or None.
    answer: Optional[str] = None
    # Per round of sub-searches: the children's final traces.
    rounds: list[list[str]] = field(default_factory=list)
    # Set if the reference would have given up (its `except` returns None).
    error: str = ""
    calls: int = 0


class APRController:
    """APR's controller.

    Args:
        bos_token: Prepended to every prompt as text (the reference's
            ``ADD_BOS``), replaced by a space in the traces.
        max_tokens: Every call's ``max_tokens``.
        budget: The children's ``Token Budget`` prefix; None for none.
        avg_sub_call: Split ``budget`` among the children.
    """

    def __init__(self,
                 bos_token: str,
                 max_tokens: int,
                 budget: Optional[int] = None,
                 avg_sub_call: bool = False):
        self.bos_token = bos_token
        self.max_tokens = max_tokens
        self.budget = budget
        self.avg_sub_call = avg_sub_call

    def decode(self, prefix: str, sampling: dict[str, Any],
               out: APRRollout) -> Generator[Calls, list, str]:
        """One trace decoded on from ``prefix`` (`decode_trace`)."""
        while True:
            params = dict(sampling,
                          stop=[SUB_SEARCHES],
                          max_tokens=self.max_tokens)
            [done] = yield [(self.bos_token + prefix, params)]
            out.calls += 1
            text = (self.bos_token + prefix + done.text).replace(
                self.bos_token, " ")
            prefix = text[1:] if text.startswith(" ") else text
            if done.stop_reason != SUB_SEARCHES:
                break
            prefix += CALLING
        if prefix.split("\n")[-1] == "":
            prefix = prefix[:-1]
        return prefix

    def rollout(self, prefix: str,
                sampling: dict[str, Any]) -> Generator[Calls, list, Any]:
        """One search (`call_search`), as a generator of calls."""
        out = APRRollout()
        trace = yield from self.decode(prefix, sampling, out)
        while calls_sub_searches(trace):
            try:
                nodes = sub_searches(trace)
            except (KeyError, IndexError, ValueError, SyntaxError) as e:
                out.error = f"{type(e).__name__}: {e}"
                break
            budget = child_budget(self.budget, len(nodes), self.avg_sub_call)
            children = yield from together([
                self.decode(node.prefix(budget), sampling, out)
                for node in nodes
            ])
            out.rounds.append(children)
            trace = yield from self.decode(
                joined_trace(trace, nodes,
                             [search_result(c) for c in children]), sampling,
                out)
        out.trace = trace
        out.answer = None if out.error else search_result(trace)
        return out


def run_apr(controller: APRController,
            backend: TextBackend,
            prefixes: list[str],
            sampling: Optional[dict[str, Any]] = None) -> list[APRRollout]:
    """Runs every search at once, each step's calls in one backend call."""
    return drive([
        controller.rollout(p, sampling or {"temperature": 0.0})
        for p in prefixes
    ], backend.generate_text)
