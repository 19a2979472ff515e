# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""APR's format when a call lists the same node twice (docs/formats.md):
the engine forks a sub-search per listing, the two from the same prompt,
and joins both results in list order, each under its own index; the
search goes on, as APR's sequential evaluation
(``--disable_parallel_inference``) and the test kit's controller run it.
APR's default thread-pool mode places both results at the first
listing's index, and the search is lost there.

The scripted model, server and engine are `test_apr`'s.
"""

import test_apr

from sequence_hooks.actions import Fork, Restart
from sequence_hooks_testkit.formats.apr_scripts import (CHILD_0, CHILD_1,
                                                        FAILS, GENERATED, ROOT,
                                                        WINS)

LISTED_TWICE = ("<Start Sub Search 0 at level 1> Moving to Node #0,0\n"
                "<Start Sub Search 1 at level 1> Moving to Node #0,0\n"
                "<Start Sub Search 2 at level 1> Moving to Node #0,1\n"
                "<End Calling Sub Searches>\n")
CALL = GENERATED + "<Calling Sub Searches>\n" + LISTED_TWICE


def test_a_node_listed_twice_is_searched_and_joined_twice():
    model = test_apr.ScriptedModel(
        [ROOT + CALL, CHILD_0 + WINS, CHILD_1 + FAILS])
    rollout, server, engine, report = test_apr.both(model)
    test_apr.assert_same(rollout, server, engine, report)
    forks = [a for a in engine.actions if isinstance(a, Fork)]
    assert [f.label for f in forks] == ["#0,0", "#0,0", "#0,1"]
    assert forks[0].context_tokens == forks[1].context_tokens
    assert [child.label
            for child in report.tree.children] == ["#0,0", "#0,0", "#0,1"]
    assert report.tree.children[0].text == report.tree.children[1].text
    [restart] = [a for a in engine.actions if isinstance(a, Restart)]
    joined = test_apr.TOKENIZER.decode(list(restart.prompt_token_ids))
    for i in (0, 1):
        assert (f"<Goal Reached in Sub Search {i} at level 1 at Node #0,0>\n"
                "51-11=40\n49-40=9 Goal Reached\n") in joined
    assert "<No Solution in Sub Search 2 at level 1 at Node #0,1>" in joined
    # The search went on after its join, to its answer.
    assert rollout.answer == "36-25=11 Goal Reached"
