# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Scripted APR searches, the texts its tests script a model with: a
root that generates two nodes and calls a sub-search on each, one that
fails and one that wins, and the root's conclusion after their join; and
a second round of two more sub-searches."""

ROOT = "Moving to Node #0\nCurrent State: 39:[25, 36, 51, 49], Operations: []"
GENERATED = ("\nExploring Operation: 51-49=2, Resulting Numbers: [25, 36, 2]\n"
             "Generated Node #0,0: 39:[25, 36, 2] Operation: 51-49=2\n"
             "Exploring Operation: 36-25=11, Resulting Numbers: [51, 49, 11]\n"
             "Generated Node #0,1: 39:[51, 49, 11] Operation: 36-25=11\n")
# The call's lines after `<Calling Sub Searches>\n`.
LISTED = ("<Start Sub Search 0 at level 1> Moving to Node #0,0\n"
          "<Start Sub Search 1 at level 1> Moving to Node #0,1\n"
          "<End Calling Sub Searches>\n")
CALL = GENERATED + "<Calling Sub Searches>\n" + LISTED
# The children's prompts (no BOS) and what each writes.
CHILD_0 = ("Moving to Node #0,0\nCurrent State: 39:[25, 36, 2], "
           "Operations: ['51-49=2']")
CHILD_1 = ("Moving to Node #0,1\nCurrent State: 39:[51, 49, 11], "
           "Operations: ['36-25=11']")
FAILS = "\nExploring Operation: 25+36=61\n61,39 unequal: No Solution\n"
WINS = ("\nExploring Operation: 51-11=40\n39,39 equal: Goal Reached\n"
        "51-11=40\n49-40=9 Goal Reached\n")
# What the root writes after the join.
CONCLUDES = ("Moving to Node #0,1\n39,39 equal: Goal Reached\n"
             "36-25=11 Goal Reached\n")
# A second round: after a first whose sub-searches both fail, the root
# expands node #0,1 and calls a sub-search on each of its two new nodes.
SECOND_CALL = (
    "Moving to Node #0,1\nCurrent State: 39:[51, 49, 11], Operations: "
    "['36-25=11']\nExploring Operation: 51-11=40, Resulting Numbers: [49, 40]"
    "\nGenerated Node #0,1,0: 39:[49, 40] Operation: 51-11=40\n"
    "Exploring Operation: 49-11=38, Resulting Numbers: [51, 38]\n"
    "Generated Node #0,1,1: 39:[51, 38] Operation: 49-11=38\n"
    "<Calling Sub Searches>\n"
    "<Start Sub Search 0 at level 1> Moving to Node #0,1,0\n"
    "<Start Sub Search 1 at level 1> Moving to Node #0,1,1\n"
    "<End Calling Sub Searches>\n")
GRANDCHILD_0 = ("Moving to Node #0,1,0\nCurrent State: 39:[49, 40], "
                "Operations: ['36-25=11', '51-11=40']")
GRANDCHILD_1 = ("Moving to Node #0,1,1\nCurrent State: 39:[51, 38], "
                "Operations: ['36-25=11', '49-11=38']")
