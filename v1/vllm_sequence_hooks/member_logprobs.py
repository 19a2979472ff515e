# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The sampled logprobs the engine core keeps for tree nodes.

A root's logprobs are its output's, which the frontend makes; a child's
never leave the engine core, so they are kept here for its node, as a
held root's are, whose output is made anew at its end
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
    """Per live member that keeps them, its current call's sampled tokens'
    logprobs in `CompletionOutput`'s form (None where merged)."""

    def __init__(self) -> None:
        self.by_member: dict[str, list] = {}
        # Per member kept, how many top logprobs it asked for.
        self.asked: dict[str, int] = {}

    def keep(self, request: Request) -> None:
        """Keeps a member's logprobs from now on (anew), if it asked
        (``logprobs`` or ``logprob_token_ids``)."""
        asked = request.sampling_params.num_logprobs
        if asked is not None:
            self.by_member[request.request_id] = []
            self.asked[request.request_id] = asked

    def sampled(self, member_id: str, new_logprobs) -> None:
        """A step's rows of a member's sampled tokens."""
        logprobs = self.by_member.get(member_id)
        if logprobs is not None and new_logprobs is not None:
            append_logprob_rows(logprobs, new_logprobs, self.asked[member_id])

    def merged(self, member_id: str, count: int) -> None:
        """``count`` tokens merged into a member: no logprobs."""
        if member_id in self.by_member:
            self.by_member[member_id] += [None] * count

    def current(self, member_id: str) -> Optional[list]:
        """A live member's logprobs so far, the list kept (to read, not to
        keep: it grows); None if it keeps none."""
        return self.by_member.get(member_id)

    def pop(self, member_id: str) -> Optional[list]:
        """A member's logprobs, no longer kept; None if it kept none."""
        self.asked.pop(member_id, None)
        return self.by_member.pop(member_id, None)


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
