# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The equivalence oracle of `mytests/oracle.py`, on a V1 engine.

Same replay (one `generate` call per segment, children over the context up
to their `<promise>` and role marker, merges tokenized and appended at each
`<sync>`); only the way a segment is scripted differs: V1 takes the script
through `SamplingParams.extra_args` and a batch-level logits processor.
"""

from sequence_hooks_testkit.oracle import ReferenceNode
from sequence_hooks_testkit.tiny_model import SPECIAL_TOKENS
from sequence_hooks_testkit.v1_scripted_logits import SCRIPT_KEY, make_script

# Never chosen on a free step: the hook tokens, EOS and the other specials.
MASKED_IDS = range(len(SPECIAL_TOKENS))


def scripted_params(plans, ids, max_tokens: int = 64, **fixed):
    """Greedy SamplingParams that run ``plans`` on a hooked V1 engine.

    Args:
        plans: Tokens per role path (see `mytests/scripted_hooks.py`).
        ids: The tiny tokenizer's hook token ids.
        max_tokens: The request's budget.
        fixed: `role` and `step` of a fixed-role script (the reference).
    """
    from vllm import SamplingParams
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        extra_args={SCRIPT_KEY: make_script(plans, ids, MASKED_IDS, **fixed)})


def reference(plain_llm,
              ids,
              plans,
              prompt_ids: list[int],
              separator: str = "\n",
              role: tuple = ()) -> ReferenceNode:
    """Runs the program's sequence ``role`` over ``prompt_ids`` hook-free.

    Args:
        plain_llm: A V1 engine without sequence hooks.
        ids: The tiny tokenizer's hook token ids.
        plans: The program: tokens per role path.
        prompt_ids: The sequence's whole context when it starts.
        separator: The merge separator the hooked engine uses.
        role: Which sequence of the program to run.

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
        context = prompt_ids + node.token_ids
        [output] = plain_llm.generate({"prompt_token_ids": context},
                                      scripted_params(plans,
                                                      ids,
                                                      max_tokens,
                                                      role=role,
                                                      step=step),
                                      use_tqdm=False)
        segment = list(output.outputs[0].token_ids)
        for i, token_id in enumerate(segment):
            if token_id == ids.promise:
                child_context = context + segment[:i + 1] + [ids.child]
                node.children.append(
                    reference(plain_llm, ids, plans, child_context, separator,
                              role + (len(node.children), )))
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
