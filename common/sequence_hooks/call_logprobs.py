# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The logprobs a member's calls sampled, kept across re-tokenized calls.

A format that works in text (APR) sends each call a prompt tokenized anew
from the trace so far, and its tree gives each node's trace re-tokenized:
the ids a call sampled may come back split otherwise. A logprob is the
model's for its token after exactly the ids before it, so a token keeps
the logprob it was sampled with only where the new ids agree with the
sampled call's up to and including it (their longest common prefix);
past that, no call sampled it after those ids, and it has none.
"""

from dataclasses import dataclass
from typing import Optional

from sequence_hooks.tree import TokenLogprobs


@dataclass(frozen=True)
class CallTokens:
    """A member's call's ids, each with the logprobs it was sampled with
    after the ids before it (None: not sampled after them).

    ``asked`` says whether the request asked for logprobs: known once a
    call has reported its sampled tokens.
    """

    ids: tuple[int, ...]
    logprobs: tuple[Optional[TokenLogprobs], ...]
    asked: bool = False

    @classmethod
    def prompt(cls, ids: list[int]) -> "CallTokens":
        """A first call's prompt: nothing sampled yet."""
        return cls(tuple(ids), (None, ) * len(ids))

    def sampled(self, ids: list[int],
                logprobs: Optional[list]) -> "CallTokens":
        """The call with the tokens it sampled appended.

        Args:
            ids: The sampled tokens.
            logprobs: Their logprobs; None if the request asked for none.

        Returns:
            The call's ids so far.
        """
        if logprobs is None:
            return CallTokens(self.ids + tuple(ids),
                              self.logprobs + (None, ) * len(ids))
        return CallTokens(self.ids + tuple(ids),
                          self.logprobs + tuple(logprobs), True)

    def carried_to(self, ids: list[int]) -> "CallTokens":
        """``ids`` (a new call's prompt, a node's ids) with the logprobs
        they keep from this call: those of their longest common prefix."""
        common = 0
        for old, new in zip(self.ids, ids):
            if old != new:
                break
            common += 1
        return CallTokens(
            tuple(ids),
            self.logprobs[:common] + (None, ) * (len(ids) - common),
            self.asked)

    def logprobs_of(self, context: list[int],
                    own: list[int]) -> Optional[list]:
        """The logprobs of ``own`` after ``context`` (a node's tokens after
        its prompt); None if the request asked for none."""
        if not self.asked:
            return None
        return list(self.carried_to(context + own).logprobs[len(context):])
