# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An engine-independent yardstick for NPR's and Multiverse's answers: a
checker and a sequential reference decoder over a Hugging Face model,
under the layout of `parallel_layout` (its module doc defines it).

- `greedy_mismatches`: one forward of the model over a whole answer with
  the layout's 4-D mask and position ids; the indices where a token the
  model sampled is not the argmax there. A greedy engine that carries out
  the layout gives none.
- `decode_sequential`: the greedy reference decoder. It decodes one token
  at a time, each with one forward over the whole sequence so far under
  the layout, and forces the engine's tokens where the engine forces
  them: at a goal close whose goal has 1 to `ParallelFormat.max_paths`
  labels, the "\\n", then per label in order the path's header
  ``"<step>\\n{label}:"``, the path decoded to its close tag and the
  "\\n" after it, then ``"<takeaway>\\n"``; the model goes on from there.
  The layout's mask makes each path see the prefix and itself only, at
  the positions it has in parallel, so this is what a parallel engine
  gives. With ``join="prefill"`` it decodes as a join that concatenates
  the paths and prefills them instead: each path in its own context
  (prefix and itself, positions counting on), the joined sequence plain
  causal at positions 0, 1, 2, ...

Imports torch and the model's transformers classes, nothing of the
engine.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch

from sequence_hooks_references.parallel_layout import (LayoutTags,
                                                       ParallelFormat,
                                                       forced_mask,
                                                       parallel_layout)

# A logit this close to the maximum counts as the argmax (the forward over
# a whole answer and the one over its prefix differ by rounding).
TOLERANCE = 1e-4


def layout_logits(model,
                  ids: list[int],
                  tags: Optional[LayoutTags],
                  layout: Callable = parallel_layout,
                  allow_open: bool = False) -> torch.Tensor:
    """One forward of ``model`` over ``ids`` under a layout.

    Args:
        model: A transformers causal LM (eager or sdpa attention: both
            honour a 4-D mask).
        ids: The token ids.
        tags: The format's tag ids.
        layout: `parallel_layout` or `prefill_layout`.
        allow_open: See `parallel_layout.parse_layout`.

    Returns:
        The logits, [L, vocab] (float32).

    Raises:
        ValueError: On a malformed sequence.
    """
    positions, mask = layout(ids,
                             tags,
                             allow_open=allow_open,
                             dtype=model.dtype)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]),
                    attention_mask=mask,
                    position_ids=positions,
                    use_cache=False)
    return out.logits[0].float()


def greedy_mismatches(model,
                      token_ids: list[int],
                      prompt_len: int,
                      tags: LayoutTags,
                      forced: Optional[list[bool]] = None,
                      layout: Callable = parallel_layout,
                      tolerance: float = TOLERANCE) -> list[int]:
    """The sampled tokens of an answer that are not the model's greedy
    choice under a layout.

    Args:
        model: A transformers causal LM.
        token_ids: Prompt and answer.
        prompt_len: The prompt's length.
        tags: The format's tag ids.
        forced: Per token, whether the engine forced it (not checked);
            `parallel_layout.forced_mask` if None.
        layout: `parallel_layout` (the default) or `prefill_layout`.
        tolerance: A token whose logit is within this of the maximum
            counts as the argmax.

    Returns:
        The indices (from ``prompt_len`` on) of sampled tokens that are
        not the argmax of the forward at the index before them.

    Raises:
        ValueError: On a malformed sequence.
    """
    if forced is None:
        forced = forced_mask(token_ids, prompt_len, tags)
    logits = layout_logits(model, token_ids, tags, layout)
    best = logits.max(dim=-1).values
    return [
        i for i in range(max(prompt_len, 1), len(token_ids))
        if not forced[i] and logits[i - 1,
                                    token_ids[i]].item() < best[i - 1].item() -
        tolerance
    ]


@dataclass(frozen=True)
class DecodedPath:
    """One path of a decoded answer."""
    label: str
    # Its header's index in the answer's ids.
    start: int
    # What follows its header through its close tag (a nested block
    # included, with its forced tokens).
    token_ids: list[int]
    # Its block's nesting depth (0: top level).
    depth: int


@dataclass
class Decoded:
    """A decoded answer."""
    # Prompt and answer.
    ids: list[int]
    # Per token of ``ids``, whether the decoder forced it.
    forced: list[bool]
    # The paths, in the order their decoding ended (a nested block's
    # paths before the path that holds them).
    paths: list[DecodedPath] = field(default_factory=list)
    # "eos", "length" (``max_tokens`` reached), "path ended" (a path
    # sampled EOS: the whole answer ends there), or "malformed: ..." (the
    # sequence left the layout; the message says where).
    finish: str = ""
    # Goal closes that forked no path (no label, or too many).
    unforked: int = 0


class _Decoder:
    """One greedy answer, decoded as `decode_sequential` says."""

    def __init__(self, model, tokenizer, fmt: ParallelFormat,
                 prompt_ids: list[int], max_tokens: int, join: str):
        if join not in ("layout", "prefill"):
            raise ValueError(f"join is 'layout' or 'prefill', not {join!r}")
        self.model, self.tokenizer, self.fmt = model, tokenizer, fmt
        self.tags = fmt.tags(tokenizer)
        self.join = join
        self.limit = len(prompt_ids) + max_tokens
        self.out = Decoded(list(prompt_ids), [False] * len(prompt_ids))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def force(self, ids: list[int], context: list[int]) -> None:
        context += range(len(self.out.ids), len(self.out.ids) + len(ids))
        self.out.ids += ids
        self.out.forced += [True] * len(ids)

    def sample(self, context: list[int]) -> int:
        ids = self.out.ids
        if self.join == "layout":
            # The whole sequence: the layout's mask hides earlier paths.
            logits = layout_logits(self.model, ids, self.tags, allow_open=True)
        else:
            # The current sequence alone, plain causal.
            with torch.no_grad():
                logits = self.model(input_ids=torch.tensor(
                    [[ids[k] for k in context]]),
                                    use_cache=False).logits[0]
        return int(logits[-1].argmax())

    def generate(self, context: list[int], depth: int,
                 in_path: bool) -> Optional[str]:
        """Decodes on ``context`` until its path closes (None) or the
        answer ends (its finish)."""
        tags = self.tags
        while True:
            if len(self.out.ids) >= self.limit:
                return "length"
            try:
                token = self.sample(context)
            except ValueError as error:
                return f"malformed: {error}"
            context.append(len(self.out.ids))
            self.out.ids.append(token)
            self.out.forced.append(False)
            if token == self.tokenizer.eos_token_id:
                return "path ended" if in_path else "eos"
            if in_path and token == tags.path_close:
                return None
            if token == tags.goal_close:
                text = self.tokenizer.decode(
                    [self.out.ids[k] for k in context],
                    skip_special_tokens=False)
                labels = self.fmt.labels(text)
                if 1 <= len(labels) <= self.fmt.max_paths:
                    ended = self.fork(context, labels, depth)
                    if ended:
                        return ended
                else:
                    self.out.unforked += 1

    def fork(self, context: list[int], labels: list[str],
             depth: int) -> Optional[str]:
        """One block: its paths one after the other, then the join."""
        newline = self.encode("\n")
        self.force(newline, context)
        fork_context = list(context)
        begin = len(self.out.ids)
        for label in labels:
            path = list(fork_context)
            start = len(self.out.ids)
            header = self.encode(self.fmt.header(label))
            self.force(header, path)
            ended = self.generate(path, depth + 1, in_path=True)
            self.out.paths.append(
                DecodedPath(label, start, self.out.ids[start + len(header):],
                            depth))
            if ended:
                return ended
            self.force(newline, path)
        context += range(begin, len(self.out.ids))
        self.force(self.encode(self.fmt.after_text()), context)
        return None


def decode_sequential(model,
                      tokenizer,
                      prompt_ids: list[int],
                      fmt: ParallelFormat,
                      max_tokens: int,
                      join: str = "layout") -> Decoded:
    """The greedy reference answer to a prompt (module doc).

    A goal close forks when its goal (the text after the last
    `ParallelFormat.goal_open`) has 1 to ``fmt.max_paths`` labels; else the
    model decodes on. A path ends at its close tag; a path that samples EOS
    ends the whole answer ("path ended"), and so does ``max_tokens``
    ("length"). A sequence that leaves the layout (say a block opened
    inside an NPR path) ends the answer ("malformed: ..."), the offending
    token kept.

    Args:
        model: A transformers causal LM (eager or sdpa attention).
        tokenizer: Its tokenizer (the tags one token each).
        prompt_ids: The prompt's token ids.
        fmt: The format (`parallel_layout.NPR`, `parallel_layout.MULTIVERSE`).
        max_tokens: The most tokens after the prompt, forced ones included.
        join: "layout" (the layout's join, the default) or "prefill" (a
            join that concatenates the paths and prefills them).

    Returns:
        The answer: ids, which were forced, the paths, the finish.
    """
    decoder = _Decoder(model, tokenizer, fmt, prompt_ids, max_tokens, join)
    context = list(range(len(prompt_ids)))
    decoder.out.finish = decoder.generate(context, 0, in_path=False)
    return decoder.out
