# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The real model's task: the capital of each of several countries.

A request names 2 to 8 countries. The system prompt selects the form:

- parallel: the parent lists the countries, each followed by a `<promise>`
  ("1. Peru<promise>\n2. Chile<promise>"), then a newline and `<sync>`
  (`LIST_END`). The child of a promise (its context ends with its own
  country, the promise and `<child>`) writes one sentence about that
  country ("For Peru: the capital city of Peru is Lima."). The engine
  appends the children's texts, joined by "\n", after the `<sync>`; the
  parent then concludes ("\nSo the capital of Peru is Lima, of Chile is
  Santiago.") and ends.
- sequential: the parent writes each country's line and then its sentence
  in turn, then the same conclusion.

Answers are checked exactly against `CAPITALS`. The countries are split by
a fixed seed into those used in training and held-out ones that only the
evaluation asks about.
"""

import random
import re
from dataclasses import dataclass
from typing import Optional

# The hook tokens, as the model's set-up adds them.
from sequence_hooks_training import prepare_base_model as set_up

CHILD, PROMISE, SYNC = set_up.CHILD, set_up.PROMISE, set_up.SYNC

SYSTEM_PARALLEL = ("You are a helpful assistant. Answer each item in its own "
                   "parallel branch.")
SYSTEM_SEQUENTIAL = ("You are a helpful assistant. Answer the items one by "
                     "one.")
MIN_ITEMS, MAX_ITEMS = 2, 8
# Countries never seen in training; chosen by `HELD_OUT_SEED`.
NUM_HELD_OUT = 36
HELD_OUT_SEED = 13
# Names with one accepted spelling; ASCII, no commas and no " and ", so that
# the conclusion parses without ambiguity.
CAPITALS = {
    "Afghanistan": "Kabul",
    "Albania": "Tirana",
    "Algeria": "Algiers",
    "Angola": "Luanda",
    "Argentina": "Buenos Aires",
    "Armenia": "Yerevan",
    "Australia": "Canberra",
    "Austria": "Vienna",
    "Azerbaijan": "Baku",
    "Bahamas": "Nassau",
    "Bahrain": "Manama",
    "Bangladesh": "Dhaka",
    "Barbados": "Bridgetown",
    "Belarus": "Minsk",
    "Belgium": "Brussels",
    "Belize": "Belmopan",
    "Bhutan": "Thimphu",
    "Botswana": "Gaborone",
    "Brunei": "Bandar Seri Begawan",
    "Bulgaria": "Sofia",
    "Burkina Faso": "Ouagadougou",
    "Cambodia": "Phnom Penh",
    "Canada": "Ottawa",
    "Cape Verde": "Praia",
    "Central African Republic": "Bangui",
    "Chile": "Santiago",
    "China": "Beijing",
    "Comoros": "Moroni",
    "Croatia": "Zagreb",
    "Cuba": "Havana",
    "Cyprus": "Nicosia",
    "Czech Republic": "Prague",
    "Denmark": "Copenhagen",
    "Djibouti": "Djibouti",
    "Dominica": "Roseau",
    "Dominican Republic": "Santo Domingo",
    "East Timor": "Dili",
    "Ecuador": "Quito",
    "Egypt": "Cairo",
    "El Salvador": "San Salvador",
    "Equatorial Guinea": "Malabo",
    "Eritrea": "Asmara",
    "Estonia": "Tallinn",
    "Ethiopia": "Addis Ababa",
    "Fiji": "Suva",
    "Finland": "Helsinki",
    "France": "Paris",
    "Gabon": "Libreville",
    "Gambia": "Banjul",
    "Georgia": "Tbilisi",
    "Germany": "Berlin",
    "Ghana": "Accra",
    "Greece": "Athens",
    "Guatemala": "Guatemala City",
    "Guinea": "Conakry",
    "Guinea-Bissau": "Bissau",
    "Guyana": "Georgetown",
    "Haiti": "Port-au-Prince",
    "Honduras": "Tegucigalpa",
    "Hungary": "Budapest",
    "Iceland": "Reykjavik",
    "India": "New Delhi",
    "Indonesia": "Jakarta",
    "Iran": "Tehran",
    "Iraq": "Baghdad",
    "Ireland": "Dublin",
    "Italy": "Rome",
    "Jamaica": "Kingston",
    "Japan": "Tokyo",
    "Jordan": "Amman",
    "Kazakhstan": "Astana",
    "Kenya": "Nairobi",
    "Kuwait": "Kuwait City",
    "Kyrgyzstan": "Bishkek",
    "Laos": "Vientiane",
    "Latvia": "Riga",
    "Lebanon": "Beirut",
    "Lesotho": "Maseru",
    "Liberia": "Monrovia",
    "Libya": "Tripoli",
    "Liechtenstein": "Vaduz",
    "Lithuania": "Vilnius",
    "Luxembourg": "Luxembourg",
    "Madagascar": "Antananarivo",
    "Malawi": "Lilongwe",
    "Malaysia": "Kuala Lumpur",
    "Mali": "Bamako",
    "Malta": "Valletta",
    "Mauritania": "Nouakchott",
    "Mauritius": "Port Louis",
    "Mexico": "Mexico City",
    "Moldova": "Chisinau",
    "Monaco": "Monaco",
    "Mongolia": "Ulaanbaatar",
    "Montenegro": "Podgorica",
    "Morocco": "Rabat",
    "Mozambique": "Maputo",
    "Namibia": "Windhoek",
    "Nepal": "Kathmandu",
    "Netherlands": "Amsterdam",
    "New Zealand": "Wellington",
    "Nicaragua": "Managua",
    "Niger": "Niamey",
    "Nigeria": "Abuja",
    "North Korea": "Pyongyang",
    "North Macedonia": "Skopje",
    "Norway": "Oslo",
    "Oman": "Muscat",
    "Pakistan": "Islamabad",
    "Panama": "Panama City",
    "Papua New Guinea": "Port Moresby",
    "Peru": "Lima",
    "Philippines": "Manila",
    "Poland": "Warsaw",
    "Portugal": "Lisbon",
    "Qatar": "Doha",
    "Romania": "Bucharest",
    "Russia": "Moscow",
    "Rwanda": "Kigali",
    "Saint Lucia": "Castries",
    "Samoa": "Apia",
    "San Marino": "San Marino",
    "Saudi Arabia": "Riyadh",
    "Senegal": "Dakar",
    "Serbia": "Belgrade",
    "Seychelles": "Victoria",
    "Sierra Leone": "Freetown",
    "Singapore": "Singapore",
    "Slovakia": "Bratislava",
    "Slovenia": "Ljubljana",
    "Solomon Islands": "Honiara",
    "Somalia": "Mogadishu",
    "South Korea": "Seoul",
    "South Sudan": "Juba",
    "Spain": "Madrid",
    "Sudan": "Khartoum",
    "Suriname": "Paramaribo",
    "Sweden": "Stockholm",
    "Switzerland": "Bern",
    "Syria": "Damascus",
    "Tajikistan": "Dushanbe",
    "Thailand": "Bangkok",
    "Tunisia": "Tunis",
    "Turkey": "Ankara",
    "Turkmenistan": "Ashgabat",
    "Uganda": "Kampala",
    "United Arab Emirates": "Abu Dhabi",
    "United Kingdom": "London",
    "Uruguay": "Montevideo",
    "Uzbekistan": "Tashkent",
    "Vanuatu": "Port Vila",
    "Venezuela": "Caracas",
    "Vietnam": "Hanoi",
    "Zambia": "Lusaka",
    "Zimbabwe": "Harare"
}


def split_countries() -> tuple[list[str], list[str]]:
    """The countries for training and the held-out ones, both sorted."""
    countries = sorted(CAPITALS)
    held_out = set(
        random.Random(HELD_OUT_SEED).sample(countries, NUM_HELD_OUT))
    return ([c for c in countries if c not in held_out], sorted(held_out))


TRAIN_COUNTRIES, HELD_OUT_COUNTRIES = split_countries()


@dataclass(frozen=True)
class Task:
    """One request: the countries to answer, in order, and the form."""
    # The countries, as the request lists them.
    countries: tuple[str, ...]
    # True: promise one child per country; False: answer them in turn.
    parallel: bool


def make_task(rng: random.Random,
              countries: list[str],
              parallel: bool,
              num_items: int = 0,
              pairs: Optional[list[tuple[str, str]]] = None) -> Task:
    """A random task over distinct countries of ``countries``.

    Args:
        rng: The source of randomness.
        countries: The countries to draw from.
        parallel: The form.
        num_items: How many countries; 0 draws from 2 to 8.
        pairs: If given, the task holds one of these pairs (drawn at
            random) among its countries, in a random order.

    Returns:
        The task.
    """
    k = num_items or rng.randint(MIN_ITEMS, MAX_ITEMS)
    if not pairs:
        return Task(tuple(rng.sample(countries, k)), parallel)
    pair = list(rng.choice(pairs))
    names = pair + rng.sample([c for c in countries if c not in pair], k - 2)
    rng.shuffle(names)
    return Task(tuple(names), parallel)


def confusable_pairs(countries: list[str]) -> list[tuple[str, str]]:
    """The pairs of ``countries`` a parent copying its list can confuse:
    they share a word (`Guinea`, `Guinea-Bissau`; `Sudan`, `South Sudan`)
    or one name begins the other (`Niger`, `Nigeria`)."""

    def words(name: str) -> set[str]:
        return set(re.split(r"[ -]", name))

    return [(a, b) for i, a in enumerate(countries) for b in countries[i + 1:]
            if words(a) & words(b) or a.startswith(b) or b.startswith(a)]


def messages_of(task: Task) -> list[dict]:
    """The chat messages of the task's request."""
    system = SYSTEM_PARALLEL if task.parallel else SYSTEM_SEQUENTIAL
    user = ("What is the capital of each of these countries: " +
            ", ".join(task.countries) + "?")
    return [{
        "role": "system",
        "content": system
    }, {
        "role": "user",
        "content": user
    }]


def item_heading(index: int, country: str) -> str:
    """The parent's line naming the ``index``-th (0-based) country."""
    return f"{index + 1}. {country}"


# What the parallel parent writes between its last promise and `<sync>`:
# the merged sentences then start on a line of their own.
LIST_END = "\n"


def item_sentence(country: str, capital: str) -> str:
    """The sentence that answers for ``country`` (at least 10 tokens).

    It opens with "For" so that the country's name follows a space, as in
    the parent's list: a BPE tokenizer then spells it with the same tokens
    the child copies from its context (a name at the start of a line is
    split differently, which the model garbled for unseen countries)."""
    return f"For {country}: the capital city of {country} is {capital}."


def sequential_answer(task: Task) -> str:
    """The sequential form's text before its conclusion: each country's
    line, then its sentence."""
    return "\n".join(f"{item_heading(i, c)}\n{item_sentence(c, CAPITALS[c])}"
                     for i, c in enumerate(task.countries))


def conclusion_of(countries: list[str], capitals: list[str]) -> str:
    """The parent's last words, after the item sentences.

    Each capital follows "of <country> is", as in its item sentence, so
    the model finds it there by the words before it (a bare list of
    capitals made it lose count and repeat or drop one)."""
    pairs = [f"of {c} is {a}" for c, a in zip(countries, capitals)]
    return "\nSo the capital " + ", ".join(pairs) + "."


def expected_sentences(task: Task) -> list[str]:
    """The correct item sentences of ``task``, in order."""
    return [item_sentence(c, CAPITALS[c]) for c in task.countries]


SENTENCE = re.compile(r"For (.+?): the capital city of (.+?) is (.+?)\.$")
# An item sentence anywhere in a text, one per line (3: the capital).
SENTENCE_IN_TEXT = re.compile(SENTENCE.pattern, flags=re.MULTILINE)
CONCLUSION = re.compile(r"So the capital (of .+)\.$")
CONCLUSION_PAIR = re.compile(r"(.+?) is (.+)")


def parse_sentence(text: str):
    """(country, capital) of an item sentence, or None (also when it names
    two different countries)."""
    match = SENTENCE.fullmatch(text.strip())
    if match is None or match[1] != match[2]:
        return None
    return match[1], match[3]


def parse_conclusion(text: str) -> dict[str, str]:
    """Country -> capital as the last line of ``text`` gives them (the
    first pair of a country counts; empty when there is no conclusion)."""
    match = CONCLUSION.fullmatch(text.strip().rsplit("\n", 1)[-1])
    if match is None:
        return {}
    given: dict[str, str] = {}
    # Names hold no commas, so ", of " only separates pairs.
    for pair in match[1].removeprefix("of ").split(", of "):
        parsed = CONCLUSION_PAIR.fullmatch(pair)
        if parsed:
            given.setdefault(parsed[1], parsed[2])
    return given


def answers_correct(task: Task, text: str) -> list[bool]:
    """Per country, whether the conclusion of ``text`` gives its capital
    exactly."""
    given = parse_conclusion(text)
    return [given.get(c) == CAPITALS[c] for c in task.countries]


def sentences_correct(task: Task, text: str) -> list[bool]:
    """Per country, whether ``text`` holds its item sentence with its
    capital exactly (both forms write the same sentences: the parallel
    form's children, merged into the parent's text, or the sequential
    form's lines). The first sentence about a country counts."""
    said = {}
    # Found anywhere in a line: a parent that syncs with no `LIST_END`
    # puts the first merged sentence right after its last list line
    # ("2. ChileFor Peru: ...").
    for match in SENTENCE_IN_TEXT.finditer(text):
        parsed = parse_sentence(match[0])
        if parsed:
            said.setdefault(parsed[0], parsed[1])
    return [said.get(c) == CAPITALS[c] for c in task.countries]
