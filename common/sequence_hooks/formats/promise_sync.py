# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Promise/sync, the format the design started from: a member that
samples `<promise>` forks a child on its whole context (its role marker
appended, if configured) and decodes on; one that samples `<sync>` waits
for its unmerged children, then their texts, joined by
``merge_separator``, are appended to it and it resumes. Its tokens and
limits are `SpecialKwargs`' own fields; it is served by both engines.
"""

from collections.abc import Callable, Sequence
from typing import Optional

from sequence_hooks.actions import (MERGED_TOKEN_LOGPROB, Action,
                                    RequestParams, Resume, StartTree,
                                    derive_seed)
from sequence_hooks.formats import FORK, PARK_RESUME, Format, FormatSetting
from sequence_hooks.lifecycle import Coordinator, FormatPolicy
from sequence_hooks.members import Member
from sequence_hooks.special_kwargs import PROMISE_SYNC, ROLES
from sequence_hooks.texts import merged_text


class PromiseSyncPolicy(FormatPolicy):
    """Promise/sync's decisions: `<promise>` forks, `<sync>` joins.

    Args:
        coordinator: The coordinator it decides for.
    """

    @property
    def forking_token_id(self) -> int:
        """`<promise>`."""
        return self.coordinator.special_kwargs.promise_token_id

    def sampled(self, member_id: str, token_ids: Sequence[int],
                params: Callable[[], RequestParams],
                logprobs: Optional[list]) -> list[Action]:
        """`<promise>` and `<sync>` are the events `promise` and `sync`,
        any other token is none."""
        special_kwargs = self.coordinator.special_kwargs
        token_id = token_ids[-1]
        if token_id == special_kwargs.promise_token_id:
            return self.promise(member_id, len(token_ids), params())
        if token_id == special_kwargs.sync_token_id:
            return self.sync(member_id, len(token_ids))
        return []

    def promise(self, member_id: str, length: int,
                params: RequestParams) -> list[Action]:
        """A member sampled `<promise>`: spawns a child unless a limit
        says no (the promise then stays an ordinary token).

        Args:
            member_id: The promising member (a root the first time).
            length: Its token count, the promise included.
            params: Its request's parameters (read for a new root only).

        Returns:
            `StartTree` at a root's first promise, then its `Fork`, if any.
        """
        coordinator = self.coordinator
        actions: list[Action] = []
        member = coordinator.member(member_id)
        if member is None:
            member = coordinator.track_root(member_id, params)
            actions.append(StartTree(member_id, member.tree.state))
        tree, node = member.tree.state, member.node
        special_kwargs = coordinator.special_kwargs
        if (len(node.children) >= special_kwargs.max_children_per_sequence
                or tree.num_spawned >= special_kwargs.max_children_per_request
                or node.depth >= special_kwargs.max_depth):
            tree.num_refused += 1
            coordinator.counts.promises_refused += 1
            return actions
        marker = special_kwargs.child_role_token_id
        seed = (None if member.seed is None else derive_seed(
            member.seed, f"child-{len(node.children)}"))
        actions.append(
            coordinator.fork(member, length, () if marker is None else
                             (marker, ), seed, member.tree.params.max_tokens))
        return actions

    def sync(self, member_id: str, length: int) -> list[Action]:
        """A member sampled `<sync>`: merges its unmerged children if all
        finished, else parks it until they have.

        Args:
            member_id: The syncing member.
            length: Its token count, the sync included.

        Returns:
            `Resume` (a merge) or `Park`; none: `<sync>` was an ordinary
            token (no unmerged child, or not a tree member).
        """
        member = self.coordinator.member(member_id)
        if member is None:
            return []
        pending = member.node.unmerged_children()
        if not pending:
            return []
        if all(child.is_finished for child in pending):
            return self.children_done(member, length)
        return [self.coordinator.park(member, length)]

    def children_done(self, member: Member, length: int) -> list[Action]:
        """Takes the unmerged children's texts: the member's resume."""
        coordinator, node = self.coordinator, member.node
        children = coordinator.take_finished_children(member)
        text = merged_text(children,
                           coordinator.special_kwargs.merge_separator)
        token_ids = coordinator.texts_of(member).encode(
            text)[:self._room(member, length)]
        coordinator.record_merged(member, length - member.start,
                                  len(token_ids))
        seed = None
        if member.seed is not None and coordinator.reseeds_on_resume:
            seed = member.seed = derive_seed(member.seed,
                                             f"resume-{node.num_merged}")
        return [
            Resume(node.request_id, tuple(token_ids), MERGED_TOKEN_LOGPROB,
                   seed)
        ]

    def _room(self, member: Member, length: int) -> int:
        """Tokens a merge may append, leaving one to sample within the
        budget and the model length."""
        room = self.coordinator.max_model_len - length
        max_tokens = member.tree.params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - (length - member.start))
        return max(room - 1, 0)


def check(special_kwargs) -> None:
    """Promise/sync's start check: its tokens given once each, distinct,
    its limits at least 1.

    Raises:
        ValueError: with the reason.
    """
    for role in ROLES:
        if (getattr(special_kwargs, f"{role}_token_id") is not None
                and getattr(special_kwargs, f"{role}_token") is not None):
            raise ValueError(f"give {role}_token_id or {role}_token, "
                             "not both")
    for role in ("sync", "promise"):
        if (getattr(special_kwargs, f"{role}_token_id") is None
                and getattr(special_kwargs, f"{role}_token") is None):
            raise ValueError(f"{role}_token_id or {role}_token is required")
    ids = {
        f"{role}_token_id": getattr(special_kwargs, f"{role}_token_id")
        for role in ROLES
        if getattr(special_kwargs, f"{role}_token_id") is not None
    }
    for name, token_id in ids.items():
        if token_id < 0:
            raise ValueError(f"{name} must be >= 0, got {token_id}")
    if len(set(ids.values())) != len(ids):
        raise ValueError(f"special token ids must differ, got {ids}")
    strings = [
        s for s in (getattr(special_kwargs, f"{role}_token") for role in ROLES)
        if s is not None
    ]
    if len(set(strings)) != len(strings):
        raise ValueError(f"special tokens must differ, got {strings}")


def _policy(coordinator: Coordinator,
            setting: FormatSetting) -> PromiseSyncPolicy:
    return PromiseSyncPolicy(coordinator)


FORMAT = Format(name=PROMISE_SYNC,
                policy=_policy,
                needs=frozenset({FORK, PARK_RESUME}),
                reads_hook_tokens=True,
                check=check,
                summary="<promise> forks a child on the whole context, "
                "<sync> joins the children's texts")
