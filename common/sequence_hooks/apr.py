# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""APR's format (docs/formats.md): a search calls sub-searches in its
text, each starts from a fresh prompt, and their results are joined as
text into the search cut back to before its call.

The trace grammar is read from Parallel-Reasoning/APR,
src/eval/parallel_infernce_utils.py (`get_subsearch_info`,
`get_search_result`, `get_main_trace_after_sub_search`) and
src/eval/eval_apr.py (`generate`, `decode_trace`), written anew; lists
in the trace are read with ``ast.literal_eval`` where the reference uses
``eval``. Both APR's controller (the test kit's `APRController`) and the
engine's lifecycle (`sequence_hooks.apr_lifecycle`) read traces with it.
"""

import ast
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

CALL, CALL_END = "<Calling Sub Searches>\n", "<End Calling Sub Searches>"
# Never the model's to write: the controller writes CALLING in its place.
SUB_SEARCHES, CALLING = "<Sub Searches>", "<Calling Sub Searches>"
GOAL = "Goal Reached"
# What reading a malformed call raises (the reference gives up on it).
MALFORMED = (KeyError, IndexError, ValueError, SyntaxError)


@dataclass(frozen=True)
class Node:
    """A search node a sub-search starts from."""

    node: str
    target: int
    nums: list[int]
    operations: list[str]

    def prefix(self, budget: Optional[int]) -> str:
        """The sub-search's prompt (without the BOS)."""
        text = (f"Moving to Node {self.node}\nCurrent State: {self.target}:"
                f"[{', '.join(map(str, self.nums))}], Operations: "
                f"{self.operations}")
        return text if budget is None else f"Token Budget: {budget} {text}"


def call_trace(bos_token: str, prefix: str, completion: str) -> str:
    """A call's trace as the reference's `generate` returns it: the BOS
    (sent as text) replaced by a space, one leading space dropped."""
    text = (bos_token + prefix + completion).replace(bos_token, " ")
    return text[1:] if text.startswith(" ") else text


def ended_trace(trace: str) -> str:
    """A trace at the end of `decode_trace`: an empty last line dropped."""
    return trace[:-1] if trace.split("\n")[-1] == "" else trace


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
            trace does not describe, or a malformed state (`MALFORMED`).
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


def cut_trace(trace: str) -> str:
    """The trace cut back to before its last call."""
    return CALL.join(trace.split(CALL)[:-1])


def joined_trace(trace: str, nodes: list[Node],
                 results: list[Optional[str]]) -> str:
    """The parent cut back to before its last call, then the children's
    results (the reference's `get_main_trace_after_sub_search`)."""
    joined = cut_trace(trace) + "<Sub Searches>\n"
    for i, (node, result) in enumerate(zip(nodes, results)):
        if result is None:
            joined += (f"<No Solution in Sub Search {i} at level 1 at Node "
                       f"{node.node}>\n")
        else:
            joined += (f"<Goal Reached in Sub Search {i} at level 1 at Node "
                       f"{node.node}>\n{result}\n")
    return joined + "<End Sub Searches>\n"


@dataclass(frozen=True)
class APRFormat:
    """APR's format for one tokenizer: how the engine turns its text into
    the token ids APR's controller would send, and back.

    Args:
        bos_token: Sent as text before every prompt (the reference's
            ``ADD_BOS``); "" if the tokenizer has none.
        encode: A prompt's text to ids, as vLLM's completions API
            tokenizes a text prompt (special tokens added).
        decode: Sampled ids to text, as vLLM's detokenizer gives it
            (special tokens skipped).
        decode_prompt: Prompt ids to text, special tokens kept.
        encode_text: Text to ids, no special tokens added.
        eos_token_id: The end-of-sequence token.
        closing: Ids whose text holds the stop string's last character
            (the only tokens that can complete it).
        budget: The children's ``Token Budget`` prefix; None: none.
        avg_sub_call: Split ``budget`` among the children.
    """

    bos_token: str
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    decode_prompt: Callable[[list[int]], str]
    encode_text: Callable[[str], list[int]]
    eos_token_id: Optional[int]
    closing: frozenset[int]
    budget: Optional[int] = None
    avg_sub_call: bool = False

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> "APRFormat":
        """The format as vLLM's completions API runs it on ``tokenizer``
        (a Hugging Face tokenizer: `encode`, `decode`, `bos_token`,
        `convert_ids_to_tokens`)."""
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        return cls(
            tokenizer.bos_token or "", tokenizer.encode,
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
            lambda text: tokenizer.encode(text, add_special_tokens=False),
            tokenizer.eos_token_id,
            frozenset(i for i, piece in enumerate(pieces)
                      if piece and SUB_SEARCHES[-1] in piece))

    def prompt_ids(self, prefix: str) -> list[int]:
        """The ids of a call's prompt: the BOS and ``prefix``."""
        return self.encode(self.bos_token + prefix)

    def prefix_of(self, prompt_ids: list[int]) -> str:
        """A request's prompt as the controller's prefix: its text with
        the BOS it was sent with off."""
        text = self.decode_prompt(prompt_ids)
        if self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return call_trace(self.bos_token, "", text)
