# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The equivalence oracle: a promise/sync program run without hooks.

`reference` replays a scripted program on a plain engine, one `generate`
call per segment: a sequence runs up to its next `<sync>` (or its end);
each `<promise>` in that segment starts a child over the context up to and
including it (plus the role marker), run the same way; at a `<sync>` with
unmerged children, their texts are joined, tokenized and appended, and the
sequence goes on from the merged context. Greedy decoding makes the hooked
engine's tokens comparable one for one. Engine-neutral: how a segment is
scripted is the flavour's `scripted_params` (V0's is here; V1's is in
`v1_engines`).
"""

from dataclasses import dataclass, field
from typing import Callable

from sequence_hooks_testkit.scripted_hooks import RolePath, ScriptedHooks
from sequence_hooks_testkit.tiny_model import SPECIAL_TOKENS


@dataclass
class ReferenceNode:
    """What one sequence of the program produced, hook-free."""
    # Tokens the sequence produced itself (merges included), after its fork.
    token_ids: list[int] = field(default_factory=list)
    # Its children, in promise order.
    children: list["ReferenceNode"] = field(default_factory=list)


def scripted(plans, ids, **fixed) -> ScriptedHooks:
    """The scripted processor over the tiny vocabulary."""
    return ScriptedHooks(plans,
                         promise_id=ids.promise,
                         child_id=ids.child,
                         eos_id=ids.eos,
                         masked_ids=range(len(SPECIAL_TOKENS)),
                         **fixed)


def scripted_params(plans, ids, max_tokens: int = 64, **fixed):
    """Greedy SamplingParams that run ``plans`` on a V0 engine.

    Args:
        plans: Tokens per role path (see `ScriptedHooks`).
        ids: The tiny tokenizer's hook token ids.
        max_tokens: The request's budget.
        fixed: `role` and `step` of a fixed-role script (the reference).
    """
    from vllm import SamplingParams
    return SamplingParams(temperature=0.0,
                          max_tokens=max_tokens,
                          logits_processors=[scripted(plans, ids, **fixed)])


def reference(plain_llm,
              ids,
              plans,
              prompt_ids: list[int],
              separator: str = "\n",
              role: RolePath = (),
              params_of: Callable = scripted_params) -> ReferenceNode:
    """Runs the program's sequence ``role`` over ``prompt_ids`` hook-free.

    Args:
        plain_llm: An engine without sequence hooks (or one on which each
            segment ends at its `<sync>` as the request's last token).
        ids: The tiny tokenizer's hook token ids.
        plans: The program: tokens per role path (see `ScriptedHooks`).
        prompt_ids: The sequence's whole context when it starts.
        separator: The merge separator the hooked engine uses.
        role: Which sequence of the program to run.
        params_of: The flavour's `scripted_params`.

    Returns:
        The sequence's tokens and, recursively, its children's.
    """
    tokenizer = plain_llm.get_tokenizer()
    plan = plans.get(role, [])
    node = ReferenceNode()
    step, num_merged = 0, 0
    while True:
        syncs = [i for i in range(step, len(plan)) if plan[i] == ids.sync]
        # Up to the next <sync>, or to the EOS forced after the plan.
        max_tokens = (syncs[0] if syncs else len(plan)) - step + 1
        params = params_of(plans, ids, max_tokens, role=role, step=step)
        context = prompt_ids + node.token_ids
        [output] = plain_llm.generate({"prompt_token_ids": context},
                                      params,
                                      use_tqdm=False)
        segment = list(output.outputs[0].token_ids)
        for i, token_id in enumerate(segment):
            if token_id == ids.promise:
                child_context = context + segment[:i + 1] + [ids.child]
                node.children.append(
                    reference(plain_llm, ids, plans, child_context, separator,
                              role + (len(node.children), ), params_of))
        node.token_ids += segment
        step += len(segment)
        if segment[-1] != ids.sync:
            return node
        pending = node.children[num_merged:]
        num_merged = len(node.children)
        if pending:
            text = separator.join(
                tokenizer.decode(child.token_ids, skip_special_tokens=True)
                for child in pending)
            node.token_ids += tokenizer.encode(text, add_special_tokens=False)
