# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The layout NPR's and Multiverse's models are trained with, as served
(`sequence_hooks_references.parallel_layout`), on hand-written sequences:
positions and masks as the published rules give them (the expected lists
written out by hand), the one departure (the "\\n" after a path's close
is in its span), the malformed sequences refused; and transformers'
Llama honours the 4-D mask on the installed release (eager and sdpa).

In the V0 suite because the mask tests need torch and transformers,
which the references' other suite (common/tests, .venv-common) does not
have.
"""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from sequence_hooks_references.parallel_layout import (MULTIVERSE, NPR,
                                                       forced_mask,
                                                       parallel_layout,
                                                       parse_layout,
                                                       prefill_layout)
from sequence_hooks_training import multiverse_task, npr_task
from sequence_hooks_training.spell_task import FORCED

# A made-up vocabulary: every distinct string of a test is one token.
VOCAB = [
    "q", "x", "y", "z", "a", "b", "c", "d", "e", "w", "1", "2", ":", "\n",
    "<guideline>", "</guideline>", "<step>", "</step>", "<takeaway>",
    "<Parallel>", "<Goal>", "</Goal>", "<Path>", "</Path>", "<Conclusion>",
    "</Conclusion>", "</Parallel>"
]
ID = {t: i for i, t in enumerate(VOCAB)}


class VocabTokenizer:
    """Encodes a text that is one entry of `VOCAB` (as a tag is one token
    of a format's models)."""

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return [ID[text]]


NPR_TAGS = NPR.tags(VocabTokenizer())
MULTIVERSE_TAGS = MULTIVERSE.tags(VocabTokenizer())

# Two NPR blocks; the first's paths are 6 and 5 long (L_i from G), the
# second's path has no "\n" after its close. Token, then its position.
NPR_SEQUENCE = [
    ("q", 0),
    ("<guideline>", 1),
    ("x", 2),
    ("</guideline>", 3),  # G = 3
    ("\n", 4),  # forced, before every span: G + 1
    ("<step>", 4),  # G + 1
    ("\n", 5),
    ("1", 6),
    (":", 7),
    ("a", 8),
    ("</step>", 9),  # L_1 = 9 - 3 = 6
    ("\n", 10),  # in path 1's span (the departure), G + L_1 + 1
    ("<step>", 4),  # G + 1 again
    ("\n", 5),
    ("2", 6),
    (":", 7),
    ("</step>", 8),  # L_2 = 5
    ("\n", 9),
    ("<takeaway>", 10),  # G + max L_i + 1 = 3 + 6 + 1
    ("\n", 11),
    ("y", 12),
    ("<guideline>", 13),  # a second block, counting on
    ("z", 14),
    ("</guideline>", 15),  # G = 15
    ("\n", 16),
    ("<step>", 16),
    ("b", 17),
    ("</step>", 18),  # L = 3; no "\n" after it: the span ends here
    ("<takeaway>", 19),
    ("w", 20),
]

# A Multiverse block whose first path holds a nested block of two paths
# (3 and 4 long); the outer paths are 16 and 5 long.
MULTIVERSE_SEQUENCE = [
    ("q", 0),
    ("<Parallel>", 1),
    ("<Goal>", 2),
    ("x", 3),
    ("</Goal>", 4),  # G = 4
    ("\n", 5),
    ("<Path>", 5),  # G + 1
    ("1", 6),
    (":", 7),
    ("<Parallel>", 8),  # nested, inside path 1
    ("<Goal>", 9),
    ("</Goal>", 10),  # G' = 10
    ("\n", 11),
    ("<Path>", 11),  # G' + 1
    ("a", 12),
    ("</Path>", 13),  # L'_1 = 3
    ("\n", 14),
    ("<Path>", 11),
    ("b", 12),
    ("c", 13),
    ("</Path>", 14),  # L'_2 = 4
    ("\n", 15),
    ("<Conclusion>", 15),  # G' + 4 + 1
    ("\n", 16),
    ("</Conclusion>", 17),
    ("\n", 18),
    ("</Parallel>", 19),
    ("</Path>", 20),  # L_1 = 20 - 4 = 16
    ("\n", 21),
    ("<Path>", 5),
    ("2", 6),
    (":", 7),
    ("d", 8),
    ("</Path>", 9),  # L_2 = 5
    ("\n", 10),
    ("<Conclusion>", 21),  # G + 16 + 1
    ("\n", 22),
    ("</Parallel>", 23),
    ("e", 24),
]


def ids_of(tokens: list[str]) -> list[int]:
    return [ID[t] for t in tokens]


def hidden_cells(visible: list[list[bool]]) -> set[tuple[int, int]]:
    """The (query, key) cells a causal mask has that ``visible`` lacks."""
    return {(q, k)
            for q in range(len(visible))
            for k in range(q + 1) if not visible[q][k]}


def block_pairs(*pairs) -> set[tuple[int, int]]:
    """The cells of later spans not seeing earlier ones: (later, earlier)
    as index ranges."""
    return {(q, k) for later, earlier in pairs for q in later for k in earlier}


def test_npr_positions_are_the_published_ones():
    ids = ids_of([t for t, _ in NPR_SEQUENCE])
    layout = parse_layout(ids, NPR_TAGS)
    assert layout.positions == [p for _, p in NPR_SEQUENCE]


def test_npr_mask_hides_sibling_spans_with_their_newline():
    ids = ids_of([t for t, _ in NPR_SEQUENCE])
    visible = parse_layout(ids, NPR_TAGS).visible()
    # Path 1 is 5..11 (its "\n" at 11 included), path 2 is 12..17.
    assert hidden_cells(visible) == block_pairs((range(12, 18), range(5, 12)))
    # The departure: path 2 does not see the "\n" after path 1 (index
    # 11), which the published mask leaves in no span, visible to it.
    assert not visible[12][11] and not visible[17][11]
    # The "\n" after the goal close is before every span: all see it.
    assert visible[5][4] and visible[12][4]
    # After the block everything sees everything.
    assert all(visible[18][:19]) and all(visible[29])


def test_multiverse_nested_positions_are_the_published_ones():
    ids = ids_of([t for t, _ in MULTIVERSE_SEQUENCE])
    layout = parse_layout(ids, MULTIVERSE_TAGS)
    assert layout.positions == [p for _, p in MULTIVERSE_SEQUENCE]
    assert [b.depth for b in layout.blocks] == [0, 1]


def test_multiverse_nested_mask():
    ids = ids_of([t for t, _ in MULTIVERSE_SEQUENCE])
    visible = parse_layout(ids, MULTIVERSE_TAGS).visible()
    # Inner paths 13..16 and 17..21; outer paths 6..28 (holding the nested
    # block) and 29..34.
    assert hidden_cells(visible) == block_pairs((range(17, 22), range(13, 17)),
                                                (range(29, 35), range(6, 29)))
    # The nested block's conclusion sees both inner paths; the outer one
    # sees everything.
    assert all(visible[22][:23]) and all(visible[35][:36])


def test_the_tensors_are_the_layout():
    ids = ids_of([t for t, _ in MULTIVERSE_SEQUENCE])
    positions, mask = parallel_layout(ids, MULTIVERSE_TAGS)
    visible = torch.tensor(parse_layout(ids, MULTIVERSE_TAGS).visible())
    assert positions.tolist() == [[p for _, p in MULTIVERSE_SEQUENCE]]
    assert mask.shape == (1, 1, len(ids), len(ids))
    assert mask.dtype == torch.float32
    assert torch.equal(mask[0, 0] == 0, visible)
    assert (mask[0, 0][~visible] == torch.finfo(torch.float32).min).all()
    _, as_bool = parallel_layout(ids, MULTIVERSE_TAGS, additive=False)
    assert torch.equal(as_bool[0, 0], visible)
    positions, mask = prefill_layout(ids)
    assert positions.tolist() == [list(range(len(ids)))]
    assert torch.equal(mask[0, 0] == 0,
                       torch.ones(len(ids), len(ids)).tril().bool())


def test_the_layout_of_a_prefix_is_the_prefix_of_the_layout():
    """What decoding one token at a time relies on: a token's position
    and mask row depend on the tokens up to it only."""
    for tokens, tags in ((NPR_SEQUENCE, NPR_TAGS), (MULTIVERSE_SEQUENCE,
                                                    MULTIVERSE_TAGS)):
        ids = ids_of([t for t, _ in tokens])
        full = parse_layout(ids, tags)
        visible = full.visible()
        for end in range(1, len(ids)):
            part = parse_layout(ids[:end], tags, allow_open=True)
            assert part.positions == full.positions[:end]
            assert part.visible() == [row[:end] for row in visible[:end]]


def test_start_reads_earlier_tags_as_plain_tokens():
    ids = ids_of(["<step>", "</guideline>", "q"] +
                 [t for t, _ in NPR_SEQUENCE])
    layout = parse_layout(ids, NPR_TAGS, start=3)
    assert layout.positions == [0, 1, 2] + [p + 3 for _, p in NPR_SEQUENCE]


@pytest.mark.parametrize(
    "tokens, tags, message",
    [
        # Unclosed: a path, a block, a Multiverse block with no close tag.
        ("q <guideline> x </guideline> \n <step> a", NPR_TAGS, "not closed"),
        ("q <guideline> x", NPR_TAGS, "not closed"),
        ("<Parallel> <Goal> </Goal> <Path> a </Path> <Conclusion> c",
         MULTIVERSE_TAGS, "not closed"),
        # A path, a path close, a goal close or an after-tag outside its
        # block's place.
        ("q <step> a </step>", NPR_TAGS, "a path at index 1 outside"),
        ("q a </step>", NPR_TAGS, "a path close at index 2 outside"),
        ("q </guideline>", NPR_TAGS, "a goal close at index 1 outside"),
        ("<guideline> <step>", NPR_TAGS, "a path at index 1 in the block"),
        ("<guideline> </guideline> <step> a <takeaway>", NPR_TAGS,
         "an after-tag at index 4"),
        ("<Parallel> <Goal> </Goal> <Path> a </Path> </Parallel>",
         MULTIVERSE_TAGS, "a block close at index 6"),
        # NPR does not nest.
        ("<guideline> </guideline> <step> <guideline>", NPR_TAGS,
         "does not nest"),
        ("<guideline> <guideline>", NPR_TAGS, "does not nest"),
        # Multiverse nests inside a path only.
        ("<Parallel> <Goal> <Parallel>", MULTIVERSE_TAGS, "outside its paths"),
        ("<Parallel> <Goal> </Goal> <Path> a </Path> <Parallel>",
         MULTIVERSE_TAGS, "outside its paths"),
    ])
def test_malformed_sequences_are_refused(tokens, tags, message):
    ids = ids_of(tokens.split(" "))
    with pytest.raises(ValueError, match=message):
        parse_layout(ids, tags)


def test_an_open_sequence_is_read_when_allowed():
    ids = ids_of(
        ["q", "<guideline>", "x", "</guideline>", "\n", "<step>", "a"])
    layout = parse_layout(ids, NPR_TAGS, allow_open=True)
    assert layout.positions == [0, 1, 2, 3, 4, 4, 5]
    assert layout.blocks[0].paths[0].end is None


@pytest.mark.parametrize("task_mod, fmt", [(npr_task, NPR),
                                           (multiverse_task, MULTIVERSE)])
def test_forced_tokens_are_the_engines(task_mod, fmt):
    """On the toys' sequences, `forced_mask` marks exactly the pieces the
    engine forces (the training data's own record)."""
    tokenizer = task_mod.build_tokenizer()
    tags = fmt.tags(tokenizer)
    rng = random.Random(7)
    for _ in range(40):
        pieces = task_mod.pieces(task_mod.make_task(rng), rng, 0.2)
        ids, forced = [], []
        for piece in pieces:
            part = tokenizer.encode(piece.text, add_special_tokens=False)
            ids += part
            forced += [piece.role == FORCED] * len(part)
        prompt_len = len(
            tokenizer.encode(pieces[0].text, add_special_tokens=False))
        assert forced_mask(ids, prompt_len, tags) == forced


def test_labels_are_read_after_the_last_goal():
    assert NPR.labels("<guideline>\n<plan>1: a</plan><plan> 2.1 : b</plan>"
                      "<plan>x: c</plan>") == ["1", "2.1"]
    assert NPR.labels("<plan>1: a</plan>") == []
    text = ("<Goal><Outline>1: a+b</Outline></Goal><Path>\n1: a+b\n"
            "<Parallel>\n<Goal>\n<Outline>1.1: a</Outline>\n"
            "<Outline>1.2: b</Outline>\n</Goal>")
    assert MULTIVERSE.labels(text) == ["1.1", "1.2"]
    assert NPR.header("2") == "<step>\n2:"
    assert MULTIVERSE.after_text() == "<Conclusion>\n"


def tiny_llama(implementation: str):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(VOCAB),
                         hidden_size=64,
                         intermediate_size=128,
                         num_hidden_layers=2,
                         num_attention_heads=2,
                         num_key_value_heads=2,
                         max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(
        config, attn_implementation=implementation).eval()


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_transformers_llama_honours_the_4d_mask(implementation):
    """Under the layout, each path's logits are those of a forward over
    the prefix and that path alone at the same positions (what an engine
    running the paths in parallel computes), and the nested block's
    conclusion's those of the whole sequence up to it; a plain causal
    forward gives others."""
    model = tiny_llama(implementation)
    assert model.config._attn_implementation == implementation
    ids = ids_of([t for t, _ in MULTIVERSE_SEQUENCE])
    positions, mask = parallel_layout(ids, MULTIVERSE_TAGS)
    with torch.no_grad():
        full = model(torch.tensor([ids]),
                     attention_mask=mask,
                     position_ids=positions).logits[0]
        causal = model(torch.tensor([ids]), position_ids=positions).logits[0]

    def alone(kept: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([[ids[k] for k in kept]]),
                         position_ids=positions[:, kept]).logits[0]

    # Outer path 2 (29..34) sees 0..5 and itself; inner path 2 (17..21)
    # sees 0..12 and itself.
    for kept in (list(range(6)) + list(range(29, 35)),
                 list(range(13)) + list(range(17, 22))):
        path = kept[-5:]
        assert torch.allclose(full[path], alone(kept)[-5:], atol=1e-5)
        assert not torch.allclose(full[path], causal[path], atol=1e-3)
