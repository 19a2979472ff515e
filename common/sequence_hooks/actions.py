# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What an engine and the promise/sync lifecycle tell each other.

The lifecycle (`sequence_hooks.lifecycle.Coordinator`) is a
"sans-IO" core, as h11 and h2 are for HTTP: an engine feeds it events and
gets back a list of actions, plain values it carries out where it already
holds its step's context. The coordinator never calls into an engine:
what it reads comes with the events.

- What the engine reports: `RequestParams` (a request's parameters, read
  at a root's first promise) and `MemberResult` (what a finished member
  produced).
- What the coordinator asks for: `StartTree`, `Fork`, `Park`, `Resume`,
  `Splice`, `Conclude`, `Restart`, `Abort`, `ReportTree`, each carried
  out in the order given.
"""

import hashlib
from dataclasses import dataclass
from typing import Any, Optional, Union

from sequence_hooks.tree import LiveTree, PromiseNode, TokenLogprobs

# Logprob given to tokens that were appended, not sampled (merged tokens,
# the role marker): they leave the cumulative logprob unchanged.
MERGED_TOKEN_LOGPROB = 0.0

# Child ids: `<root request id>/promise-<k>`, where k counts the children
# spawned in the root's tree before this one (0 for the first), whatever
# their parents. The root's id is its engine request's (a sample's own id
# when a request has `n > 1`), so ids are unique per engine.
#
# Seeds: a seeded request's child gets `derive_seed(parent seed,
# "child-<i>")`, i its index among its parent's children; a resume that
# re-creates its member's random generator (an engine that prefills merged
# tokens anew) gets `derive_seed(seed, "resume-<k>")`, k the member's
# children merged so far, this merge's included.


def child_request_id(root_id: str, index: int) -> str:
    """The id of the ``index``-th child spawned in ``root_id``'s tree."""
    return f"{root_id}/promise-{index}"


def derive_seed(seed: int, purpose: str) -> int:
    """A deterministic seed for a child or a resume of a seeded sequence.

    Args:
        seed: The parent's (or resuming member's) seed.
        purpose: What the seed is for, e.g. "child-0" or "resume-1".

    Returns:
        A non-negative 63-bit seed.
    """
    digest = hashlib.blake2b(f"{seed}:{purpose}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


@dataclass(frozen=True)
class RequestParams:
    """What the lifecycle reads of a request: where its own tokens start
    and its sampling parameters."""

    # Its prompt's length: the root's own tokens start there.
    prompt_len: int
    # Own tokens each member may produce (merged ones count); None: up to
    # the model length.
    max_tokens: Optional[int]
    # Own tokens each member produces before it may stop.
    min_tokens: int = 0
    # The request's seed; None if unseeded.
    seed: Optional[int] = None
    # The request's stop strings.
    stop: tuple[str, ...] = ()
    # The request's own text codec (`sequence_hooks.texts.Texts`: a LoRA
    # adapter's tokenizer); None: the model's.
    texts: Any = None
    # The ids its calls stop at besides EOS: its own `stop_token_ids`
    # and, as vLLM adds them, the generation config's other EOS ids.
    stop_token_ids: tuple[int, ...] = ()
    # The tokenizer's EOS id; None: unknown (no stop id is then told
    # from EOS).
    eos_token_id: Optional[int] = None

    @classmethod
    def of(cls,
           prompt_len: int,
           max_tokens: Optional[int],
           sampling_params: Any,
           texts: Any = None) -> "RequestParams":
        """What the lifecycle reads of a vLLM request, either engine's.

        Args:
            prompt_len: Its prompt's length.
            max_tokens: Its own-token budget (the engine's reading of it).
            sampling_params: Its `SamplingParams` (`min_tokens`, `seed`,
                `stop`, `stop_token_ids`: the same fields on V0 and V1;
                `eos_token_id`, where the engine sets it: V1).
            texts: Its own text codec, if not the model's.

        Returns:
            The parameters.
        """
        return cls(prompt_len, max_tokens,
                   sampling_params.min_tokens, sampling_params.seed,
                   tuple(sampling_params.stop or ()), texts,
                   tuple(sampling_params.stop_token_ids or ()),
                   getattr(sampling_params, "eos_token_id", None))

    def ends_call_at_own_stop(self, token_id: int) -> bool:
        """Whether a call that stopped at ``token_id`` stopped at one of
        the request's stop ids that is not EOS."""
        return (token_id in self.stop_token_ids
                and token_id != self.eos_token_id)


@dataclass(frozen=True)
class MemberResult:
    """What a finished member produced, as its engine has it."""

    # Its own tokens (after its context), merged ones included.
    token_ids: list[int]
    # Its own text as the engine detokenized it (hook token strings may
    # show); None: the coordinator decodes ``token_ids``.
    text: Optional[str]
    # Per own token, its logprobs (merged tokens' entries are replaced by
    # None); None unless the request asked for logprobs.
    logprobs: Optional[list[Optional[TokenLogprobs]]] = None


@dataclass(frozen=True)
class StartTree:
    """A request's first promise made it a tree's root: from now on the
    engine reports its finish (`Coordinator.finished`)."""

    root_id: str
    # The tree's live record, which an engine may read for its outputs
    # (only the coordinator changes it).
    tree: LiveTree
    # The root's outputs are held back until `ReportTree` gives them (a
    # format that rewrites its text: APR).
    holds_output: bool = False


@dataclass(frozen=True)
class Fork:
    """Start a child: its context is its parent's whole context and
    ``context_tokens``, sharing the parent's KV cache. Everything not
    named here is its parent's sampling parameters, except that it has no
    prompt logprobs."""

    # Its request id (`lifecycle.child_request_id`).
    request_id: str
    # The promising member's request id.
    parent_id: str
    # Tokens appended to the parent's whole context to make the child's
    # (the role marker, if configured); they are not its own tokens.
    context_tokens: tuple[int, ...]
    # Its own tokens' budget and minimum, counted from its first own token.
    max_tokens: Optional[int]
    min_tokens: int
    # Its seed; None if the request is unseeded.
    seed: Optional[int]
    # Stop strings it honours, as its request does.
    stop: tuple[str, ...]
    # Token ids it stops at besides its request's (kept as its last
    # token, as vLLM keeps a matched stop id): a format's branch end.
    stop_token_ids: tuple[int, ...] = ()
    # Its label in the tree (a format's branch label); None: none.
    label: Optional[str] = None
    # ``context_tokens`` are its whole context, a fresh prompt sharing
    # nothing with its parent (APR's sub-searches).
    fresh: bool = False
    # ``(k, shift)``: from ``context_tokens[k]`` on, its tokens' positions
    # are their parent's scheme shifted by ``shift`` (a path that starts
    # where its siblings do, as NPR and Multiverse train); None: they
    # follow on.
    position_shift: Optional[tuple[int, int]] = None


@dataclass(frozen=True)
class Park:
    """Stop scheduling a member; it keeps its KV cache."""

    member_id: str


@dataclass(frozen=True)
class Resume:
    """Append tokens to a member (parked or not) and schedule it again,
    computing only the new tokens."""

    member_id: str
    # The merged tokens, already cut to leave room for one sampled token.
    token_ids: tuple[int, ...]
    # The logprob each merged token gets where logprobs are reported.
    token_logprob: float
    # Re-create the member's random generator from this seed (an engine
    # that re-creates it at a resume, `Coordinator.reseeds_on_resume`);
    # None: keep it.
    seed: Optional[int]


@dataclass(frozen=True)
class SplicedPath:
    """A finished child whose computed tokens a `Splice` reuses."""

    member_id: str
    # The range of its whole token ids (its context's included) that
    # joins, by index; every one is computed.
    start: int
    end: int
    # The index of its closing tag: what follows the join is positioned
    # one past the highest closing tag's position.
    anchor: int


@dataclass(frozen=True)
class Splice:
    """Join a parked member's paths by their KV: its context continues
    with each path's tokens (`SplicedPath`), in order, computing none of
    them, each at the positions it had in its path, then with
    ``closing_token_ids``, the only tokens computed, positioned one past
    the highest path anchor's. The paths' requests end here."""

    member_id: str
    paths: tuple[SplicedPath, ...]
    closing_token_ids: tuple[int, ...]
    # The logprob each joined token gets where logprobs are reported.
    token_logprob: float


@dataclass(frozen=True)
class Conclude:
    """Append tokens to a member's output and end it there, computing
    none of them (a format's last join); the engine then reports its
    finish."""

    member_id: str
    # The tokens, already cut to the member's budget.
    token_ids: tuple[int, ...]
    # The logprob each gets where logprobs are reported.
    token_logprob: float
    # "stop", or "length" where the budget or the model's length ended
    # the member (its tokens cut there).
    finish_reason: str = "stop"


@dataclass(frozen=True)
class Restart:
    """End a member's current call and decode it on from a new prompt,
    under the same request id and sampling parameters, with a new budget
    and a new random generator: a format's next call as its controller
    makes it (APR re-sends rewritten text; a seeded ThreadWeaver call
    re-seeds). The old call's KV is freed; an engine's prefix cache keeps
    what the new prompt shares with it."""

    member_id: str
    # The new call's whole prompt.
    prompt_token_ids: tuple[int, ...]
    # Tokens the member's output shows first (a join's), uncomputed.
    shown_token_ids: tuple[int, ...] = ()
    # The logprob each shown token gets where logprobs are reported.
    token_logprob: float = MERGED_TOKEN_LOGPROB
    # The new call's budget; None: the request's own (one call's).
    max_tokens: Optional[int] = None


@dataclass(frozen=True)
class Abort:
    """Abort members, deepest first; no output for them. A member the
    engine has finished already (its finish not reported yet) is skipped:
    the lifecycle recorded it aborted, and its report is void."""

    member_ids: tuple[str, ...]


@dataclass(frozen=True)
class ReportTree:
    """A root finished: its tree goes with its final output."""

    root_id: str
    tree: PromiseNode
    # A root whose outputs were held (`StartTree.holds_output`): its whole
    # output, replacing every token it sampled; None: not held.
    output_token_ids: Optional[tuple[int, ...]] = None


Action = Union[StartTree, Fork, Park, Resume, Splice, Conclude, Restart, Abort,
               ReportTree]
