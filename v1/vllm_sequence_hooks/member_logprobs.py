# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The sampled logprobs the engine core keeps for tree nodes.

A root's logprobs are its output's, which the frontend makes; a child's
never leave the engine core, so they are kept for its node (in its
record, `members.MemberRecord`), as a held root's are, whose output is
made anew at its end
(`output_logprob_rows`). A member that restarts its call (`Restart`)
keeps its new call's only: the lifecycle carries the old call's over
(`sequence_hooks.call_logprobs`).
"""

from typing import Optional

from vllm_sequence_hooks.transport import merged_rows

from sequence_hooks.actions import MERGED_TOKEN_LOGPROB
from sequence_hooks.tree import TokenLogprobs
from vllm.logprobs import append_logprobs_for_next_position
from vllm.v1.outputs import LogprobsLists
from vllm.v1.request import Request


class MemberLogprobs:
    """One member's current call's sampled tokens' logprobs, in
    `CompletionOutput`'s form (None where merged).

    Args:
        num_logprobs: How many top logprobs its request asked for.
    """

    def __init__(self, num_logprobs: int) -> None:
        self.num_logprobs = num_logprobs
        self.entries: list = []

    @classmethod
    def of(cls, request: Request) -> Optional["MemberLogprobs"]:
        """The logprobs to keep for a member's call.

        Args:
            request: The call's request.

        Returns:
            Its kept logprobs, none yet; None if it asked for none
            (``logprobs`` or ``logprob_token_ids``).
        """
        asked = request.sampling_params.num_logprobs
        return None if asked is None else cls(asked)

    def sampled(self, new_logprobs: Optional[LogprobsLists]) -> None:
        """A step's rows of the member's sampled tokens (None: none)."""
        if new_logprobs is not None:
            append_logprob_rows(self.entries, new_logprobs, self.num_logprobs)

    def merged(self, count: int) -> None:
        """``count`` tokens merged into the member: no logprobs."""
        self.entries += [None] * count


def output_logprob_rows(token_ids: list[int],
                        entries: Optional[list[Optional[TokenLogprobs]]],
                        num_logprobs: int) -> LogprobsLists:
    """Logprob rows of an output sent whole (a held root's): each
    token's row as the step that sampled it gave it, rebuilt from its
    entries (`CompletionOutput` form); a token with none (not sampled
    after these ids) gets the merged tokens' row.

    Args:
        token_ids: The output's tokens.
        entries: Per token, its entries or None; None: none for any.
        num_logprobs: The request's ``logprobs``.

    Returns:
        The rows, one per token, the sampled token first.
    """
    entries = entries or [None] * len(token_ids)
    if num_logprobs < 0:
        # All the vocabulary's: as many as any sampled token's entries.
        num_logprobs = max((len(e) for e in entries if e), default=0)
    ids, values, ranks, _ = rows = merged_rows(token_ids, num_logprobs + 1,
                                               MERGED_TOKEN_LOGPROB)
    for row, (token, entry) in enumerate(zip(token_ids, entries)):
        if entry is None:
            continue
        ranks[row] = entry[token].rank
        values[row, 0] = entry[token].logprob
        # The top tokens' columns, by rank (the sampled one among them
        # if it ranks there); a rank the entries lack (rows of repeated
        # ids collapse, as upstream's for ``logprob_token_ids`` batches)
        # repeats the sampled token.
        by_rank = {logprob.rank: (t, logprob) for t, logprob in entry.items()}
        for column in range(1, num_logprobs + 1):
            top, logprob = by_rank.get(column, (token, entry[token]))
            ids[row, column] = top
            values[row, column] = logprob.logprob
    return rows


def append_logprob_rows(logprobs: list, new_logprobs: LogprobsLists,
                        num_logprobs: int) -> None:
    """Appends a step's logprob rows of a member's sampled tokens to its
    logprobs, as the frontend does for an output's.

    Args:
        logprobs: The member's logprobs so far, in `CompletionOutput`'s
            form.
        new_logprobs: The step's rows (`EngineCoreOutput.new_logprobs`),
            as wide as the batch's largest request asked.
        num_logprobs: How many the member asked for: the rows are cut to
            them, as the frontend cuts an output's.
    """
    token_ids, values, ranks, _ = new_logprobs
    for row_ids, row_logprobs, rank in zip(token_ids, values, ranks):
        append_logprobs_for_next_position(logprobs, row_ids.tolist(),
                                          row_logprobs.tolist(),
                                          [None] * len(row_ids), int(rank),
                                          num_logprobs)
