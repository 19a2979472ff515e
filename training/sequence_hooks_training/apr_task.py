# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The task of models/apr-toy: Countdown in APR's trace format.

The facts come from Parallel-Reasoning/APR (written anew here): the tasks
as `src/data/countdown.py` and `generate_problems.py` make them (4 numbers
in [1, 99], a target in [10, 100], solvable with + - * / over integers),
the search and its traces as `src/data/search.py` (`_parallel_search`,
`get_path_to_target`) and `generate_apr.py` write them, the check of an
answer as `src/eval/parallel_infernce_utils.py` (`check_solution`). The
root prompt is what `eval_apr.py`'s `get_prefix` builds::

    Moving to Node #0
    Current State: 39:[25, 36, 51, 49], Operations: []

The parent writes the first level of its search, then calls one
sub-search per node it generated::

    Exploring Operation: 51-49=2, Resulting Numbers: [25, 36, 2]
    Generated Node #0,0: 39:[25, 36, 2] Operation: 51-49=2
    ...
    <Calling Sub Searches>
    <Start Sub Search 0 at level 1> Moving to Node #0,0
    <Start Sub Search 1 at level 1> Moving to Node #0,1
    <End Calling Sub Searches>

Each child starts from a fresh prompt (``Moving to Node #0,0`` and its
``Current State`` line), runs a beam search of its own, and ends with
``No solution found.`` or ``T,T equal: Goal Reached`` and its winning
path. The controller cuts the parent back to before the call, joins the
children's results in a ``<Sub Searches>`` ... ``<End Sub Searches>``
block, and the parent writes the answer (``T,T equal: Goal Reached`` and
the winning path from the root, which is what `search_result` reads) or
``No solution found.``.

Of APR's generator parameters, the toy's data takes small beams
(`BEAM`, `SUB_BEAM`) and a ``promising_threshold`` of 1, so that the parent
always calls its sub-searches at the root and traces stay short on CPU.
"""

import heapq
import itertools
import random
import re
from dataclasses import dataclass, field
from typing import Optional

from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast

from sequence_hooks_training.toy_tokenizer import (BOS, EOS, PAD, UNK,
                                                   word_level, wrapped)

# The generator's side of the format (search.py); the controller's side
# reads it (`sequence_hooks.formats.apr`). Kept apart so that training needs no
# engine package.
CALL, CALL_END = "<Calling Sub Searches>\n", "<End Calling Sub Searches>"
# Every printable ASCII character is a token of its own (digits too), so
# any such text round-trips; the format's frequent phrases are added
# (normal, not special) tokens so that traces stay short. None holds a
# newline and none starts with "]", which the re-tokenization note in
# `build_tokenizer` relies on.
PHRASES = [
    "Moving to Node #", "Current State: ", ", Operations: ",
    "Exploring Operation: ", ", Resulting Numbers: ", "Generated Node #",
    " Operation: ", " equal: Goal Reached", " unequal: No Solution",
    "No solution found.", "<Calling Sub Searches>",
    "<End Calling Sub Searches>", "<Sub Searches>", "<End Sub Searches>",
    "<Start Sub Search ", " at level 1> Moving to Node #",
    "<Goal Reached in Sub Search ", "<No Solution in Sub Search ",
    " at level 1 at Node #", ", ", "['", "', '", "']"
]
# APR's generator draws the parent's beam in [min_beam_size,
# max_beam_size] and the children's in [that beam, max_sub_call_beam_size]
# (its release: 1-10 and up to 15); the toy's are small.
BEAM, SUB_BEAM = (2, 3), 3
PROMISING = 1.0
LEVEL = 1


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The toy's tokenizer: one token per printable ASCII character, the
    format's phrases as added normal tokens, ``<s>``/``</s>`` special.

    Nothing is added on encoding (the controller prepends ``<s>`` as
    text), so ``encode("<s>" + text)`` is ``[bos_id] + encode(text)``, and
    ``decode(encode(text)) == text`` for any printable ASCII text with
    newlines.

    Re-tokenization: added tokens are matched leftmost-longest before the
    characters, so ``encode(a + b) == encode(a) + encode(b)`` holds
    whenever no phrase spans the boundary. It holds at every boundary the
    controller makes: after ``<s>``; after a prompt, which ends with
    ``]`` (no phrase starts with ``]`` or spans a newline); and in a join,
    whose pieces all end with a newline. It does not hold in general, e.g.
    ``encode("2, Resulting Numbers: [")`` is one phrase ``, Resulting
    Numbers: `` after ``2`` where ``encode("2,") + encode(" Resulting
    Numbers: [")`` has ``,`` and single characters; so a model that
    samples a phrase character by character gets other ids back after a
    join.
    """
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    backend = word_level(chars, r"[\s\S]")
    backend.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t in (UNK, BOS, EOS, PAD)
    ])
    backend.add_tokens(
        [AddedToken(p, normalized=False, special=False) for p in PHRASES])
    return wrapped(backend)


@dataclass(frozen=True)
class Task:
    """A Countdown task: reach ``target`` from ``nums``."""
    target: int
    nums: tuple[int, ...]


def combine(a: int, b: int) -> list[tuple[int, str]]:
    """The results of ``a`` and ``b`` and their operations, in APR's order
    (no negative or fractional results)."""
    small, big = min(a, b), max(a, b)
    out = [(a + b, f"{a}+{b}={a + b}"), (a * b, f"{a}*{b}={a * b}"),
           (big - small, f"{big}-{small}={big - small}")]
    if small and big % small == 0:
        out.append((big // small, f"{big}/{small}={big // small}"))
    return out


def _successors(nums: list[int]):
    for i, j in itertools.combinations(range(len(nums)), 2):
        rest = [n for k, n in enumerate(nums) if k not in (i, j)]
        for result, operation in combine(nums[i], nums[j]):
            yield rest + [result], operation


def solvable(target: int, nums: list[int]) -> bool:
    """Whether some order of operations reaches ``target``."""
    if len(nums) == 1:
        return nums[0] == target
    return any(solvable(target, new) for new, _ in _successors(nums))


def make_task(rng: random.Random) -> Task:
    """A solvable task as APR's generator draws it: a target in [10, 100],
    then 4 numbers in [1, 99] until some solution reaches it."""
    target = rng.choice(range(10, 101))
    while True:
        nums = [rng.randint(1, 99) for _ in range(4)]
        if solvable(target, nums):
            return Task(target, tuple(nums))


def prompt_of(task: Task) -> str:
    """The root prompt (APR's `get_prefix`, the controller's root)."""
    return (f"Moving to Node #0\nCurrent State: {task.target}:"
            f"{list(task.nums)}, Operations: []")


@dataclass(frozen=True)
class Piece:
    """A run of text in a training sequence; ``trained`` if the model
    writes it (else the prompt or the controller gives it)."""
    text: str
    trained: bool


def heuristic(nums: list[int], target: int) -> float:
    """APR's `mult_heuristic`: the summed distance of each number to its
    nearest factor of the target (the target included)."""
    factors = [f for f in range(2, target + 1) if target % f == 0]
    return sum(min(abs(n - f) for f in factors) for n in nums)


@dataclass
class SearchNode:
    """A search state; ``idx`` is its id in the trace (``0,2,1``)."""
    nums: list[int]
    operations: list[str]
    score: float
    parent: Optional["SearchNode"] = None
    idx: str = "0"


def path_text(goal: SearchNode, start: SearchNode, target: int) -> str:
    """APR's `get_path_to_target`: the winning path from ``start`` to
    ``goal``, ending with the goal line."""
    nodes = [goal]
    while nodes[-1] is not start:
        nodes.append(nodes[-1].parent)
    nodes.reverse()
    text = f"Moving to Node #{start.idx}\n"
    for node, following in zip(nodes, nodes[1:]):
        text += (f"Current State: {target}:{node.nums}, Operations: "
                 f"{node.operations}\nExploring Operation: "
                 f"{following.operations[-1]}, Resulting Numbers: "
                 f"{following.nums}\n")
        if following is goal:
            return text + f"{target},{target} equal: Goal Reached\n"
        text += (f"Generated Node #{following.idx}: {target}:"
                 f"{following.nums} Operation: {following.operations[-1]}\n"
                 f"Moving to Node #{following.idx}\n")
    raise ValueError("goal is not below start")


@dataclass
class Search:
    """One search's training sequences, as APR trains them: each call of
    the parent and each child apart, from its own fresh prompt."""
    # The parent's calls, in order; the last is what the controller ends
    # with. Each starts with its prompt piece.
    calls: list[list[Piece]] = field(default_factory=list)
    # Per round of sub-searches, each child's sequence.
    rounds: list[list[list[Piece]]] = field(default_factory=list)
    goal: Optional[SearchNode] = None

    def sequences(self) -> list[list[Piece]]:
        """Every training sequence: the parent's calls, then the
        children's."""
        return self.calls + [c for r in self.rounds for c in r]

    def text(self) -> str:
        """The parent's final trace as the controller ends with it."""
        text = "".join(p.text for p in self.calls[-1])
        return text.removesuffix(EOS).removesuffix("\n")


def search(task: Task,
           rng: random.Random,
           beam: int,
           sub_beam: int,
           promising: float = PROMISING,
           start: Optional[SearchNode] = None) -> Search:
    """APR's `_parallel_search` from ``start`` (the root if None): a beam
    search whose level-0 node, when it generates more than one node and a
    draw below ``promising`` says so, calls one sub-search per node.

    Args:
        task: The task.
        rng: Shuffles the kept nodes and draws ``promising``.
        beam: Nodes expanded at a time and successors kept per node.
        sub_beam: The children's ``beam``.
        promising: The chance that a node calls sub-searches.
        start: A child's start node; None for the root (level 0).

    Returns:
        The sequences (a child's: one, never calling).
    """
    target, level = task.target, 0 if start is None else LEVEL
    if start is None:
        start = SearchNode(list(task.nums), [],
                           heuristic(list(task.nums), target))
    out = Search()
    # A child's prompt as the controller makes it (`get_subsearch_info`):
    # the first two lines of its trace.
    prompt = (f"Moving to Node #{start.idx}\nCurrent State: {target}:"
              f"{start.nums}, Operations: {start.operations}")
    # The current call's pieces and what the model has written since.
    pieces, written = [Piece(prompt, False)], "\n"
    count = itertools.count()
    heap = [(start.score, next(count), start)]

    def finish(last: str) -> Search:
        out.calls.append(pieces + [Piece(written + last + EOS, True)])
        return out

    while heap:
        current = [
            heapq.heappop(heap)[-1] for _ in range(min(beam, len(heap)))
        ]
        for i, node in enumerate(current):
            if node is not start:
                written += f"Current State: {target}:{node.nums}, " \
                    f"Operations: {node.operations}\n"
            kept = sorted((SearchNode(nums, node.operations + [op],
                                      heuristic(nums, target), node)
                           for nums, op in _successors(node.nums)),
                          key=lambda n: n.score)[:beam]
            rng.shuffle(kept)
            explore: list[SearchNode] = []
            for new in kept:
                new.idx = f"{node.idx},{len(explore)}"
                op = new.operations[-1]
                written += (f"Exploring Operation: {op}, Resulting Numbers: "
                            f"{new.nums}\n")
                if new.nums == [target]:
                    out.goal = new
                    return finish(f"{target},{target} equal: Goal Reached\n" +
                                  path_text(new, start, target))
                if len(new.nums) == 1:
                    written += f"{new.nums[0]},{target} unequal: No Solution\n"
                else:
                    written += (f"Generated Node #{new.idx}: {target}:"
                                f"{new.nums} Operation: {op}\n")
                    explore.append(new)
            explore.sort(key=lambda n: n.score)
            if level == 0 and len(explore) > 1 and rng.random() < promising:
                children = [
                    search(task, rng, sub_beam, sub_beam, promising, n)
                    for n in explore
                ]
                out.rounds.append([c.calls[0] for c in children])
                out.calls.append(
                    pieces + [Piece(written + call_text(explore) + EOS, True)])
                pieces = pieces + [
                    Piece(written, True),
                    Piece(join_text(explore, children, target), False)
                ]
                written = ""
                won = next((c.goal for c in children if c.goal), None)
                if won:
                    out.goal = won
                    return finish(f"{target},{target} equal: Goal Reached\n" +
                                  path_text(won, start, target))
            else:
                for new in explore:
                    heapq.heappush(heap, (new.score, next(count), new))
            # APR's loop here reuses `idx` from the sub-search loops, which
            # after a failed call may skip or misname this line; the toy's
            # data (calls at the root only) never reaches that case.
            if i < len(current) - 1:
                written += f"Moving to Node #{current[i + 1].idx}\n"
        if heap:
            written += f"Moving to Node #{heap[0][-1].idx}\n"
    return finish("No solution found.\n")


def call_text(nodes: list[SearchNode]) -> str:
    """The parent's call of one sub-search per node."""
    return CALL + "".join(
        f"<Start Sub Search {i} at level {LEVEL}> Moving to Node #{n.idx}\n"
        for i, n in enumerate(nodes)) + CALL_END + "\n"


def join_text(nodes: list[SearchNode], children: list[Search],
              target: int) -> str:
    """The block the controller joins into the parent (the reference's
    `get_main_trace_after_sub_search`)."""
    text = "<Sub Searches>\n"
    for i, (node, child) in enumerate(zip(nodes, children)):
        if child.goal is None:
            text += (f"<No Solution in Sub Search {i} at level {LEVEL} at "
                     f"Node #{node.idx}>\n")
        else:
            text += (f"<Goal Reached in Sub Search {i} at level {LEVEL} at "
                     f"Node #{node.idx}>\n" +
                     path_text(child.goal, node, target))
    return text + "<End Sub Searches>\n"


def random_search(task: Task, rng: random.Random) -> Search:
    """The task's search with beams drawn as APR's generator draws them."""
    beam = rng.randint(*BEAM)
    sub_beam = rng.randint(beam, SUB_BEAM) if beam < SUB_BEAM else SUB_BEAM
    return search(task, rng, beam, sub_beam)


_OPERATION = re.compile(r"Exploring Operation:\s*(\d+)([+\-*/])(\d+)=(\d+),"
                        r"\s*Resulting Numbers:\s*\[(.*?)\]")


def value_of(x: int, op: str, y: int) -> Optional[float]:
    """``x op y`` as APR's check computes it (``/`` exactly); None for a
    division by zero."""
    if op == "/":
        return x / y if y else None
    return {"+": x + y, "-": x - y, "*": x * y}[op]


def check_solution(prompt: str, solution: Optional[str]) -> bool:
    """Whether ``solution`` (a winning path) solves the task of
    ``prompt``: APR's `check_solution`. Each operation must use numbers
    the path has, compute right and give the stated numbers, and the
    numbers at ``Goal Reached`` must be the target alone."""
    found = re.search(r"Current State:\s*(\d+):\[(.*?)\]", prompt)
    if not found or solution is None:
        return False
    target = int(found.group(1))
    numbers = [int(n) for n in found.group(2).split(",") if n.strip()]
    for line in solution.splitlines():
        step = _OPERATION.search(line)
        if step:
            x, op, y, z = (int(step.group(1)), step.group(2),
                           int(step.group(3)), int(step.group(4)))
            stated = [int(n) for n in step.group(5).split(",") if n.strip()]
            left = list(numbers)
            try:
                left.remove(x)
                left.remove(y)
            except ValueError:
                return False
            if value_of(x, op, y) != z or sorted(left + [z]) != sorted(stated):
                return False
            numbers = stated
        if "Goal Reached" in line:
            return numbers == [target]
    return False
