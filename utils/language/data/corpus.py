"""Generator of `data=wikitext_sample`: a small corpus the project makes itself, in the WikiText format.

No real text is copied: a seeded random world of invented places and people (names built from
syllables) is described by a small probabilistic grammar of sentence templates written for this
file, with common English function words. Every fact is consistent across the corpus (a person's
birthplace, years and age at death, a town's founder, region and river), the phrasing is
formulaic and numbers follow WikiText's tokenization (` @,@ `, ` @.@ `, ` @-@ `), so a small model
learns it quickly: a tiny GPT reaches a validation perplexity far below the unigram perplexity within
minutes on a CPU (the figures: docs/measurements.md).
Articles are split between train (10 of 12), valid and test (1 of 12 each): with the word tokenizer
about 417k / 40k / 41k tokens and a vocabulary of about 1,400 words (many of them years and numbers),
2.5 MB on disk.

    <folder>/wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from utils import ConfigError
from utils.data.cache import user_cache_dir

VERSION = 1  # bump when the generated text changes, so stale copies are not reused
FILES = ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens")
NUM_PLACES, NUM_PEOPLE = 400, 560

ONSETS = ("b", "br", "d", "dr", "f", "g", "k", "kr", "l", "m", "n", "p", "r", "s", "t", "th", "v", "z")
VOWELS = ("a", "e", "i", "o", "u", "ae", "ei", "ou")
CODAS = ("", "n", "r", "l", "s", "th", "m", "nd", "rk")
PLACE_ENDINGS = ("", "", "ford", "mere", "holm", "wick", "stead", "dale")
SURNAME_ENDINGS = ("", "son", "er", "ard", "ley", "ton")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")
DIRECTIONS = ("north", "south", "east", "west", "north @-@ east", "north @-@ west", "south @-@ east",
              "south @-@ west")
POPULATIONS = {"village": (200, 2000), "town": (2000, 30000), "city": (30000, 400000), "port": (5000, 90000)}
KINDS = tuple(POPULATIONS)
INDUSTRIES = ("fishing", "mining", "weaving", "farming", "trade", "shipbuilding", "brewing", "timber")
OCCUPATIONS = ("painter", "poet", "engineer", "composer", "general", "merchant", "architect", "astronomer")
WORKS = {"painter": "paintings", "poet": "poems", "engineer": "bridges", "composer": "symphonies",
         "general": "campaigns", "merchant": "ships", "architect": "buildings", "astronomer": "papers"}
ADJECTIVES = ("small", "large", "old", "quiet", "busy", "prosperous", "remote", "important")
LANDMARKS = ("castle", "cathedral", "harbour", "market hall", "tower", "abbey", "town hall", "lighthouse")


@dataclass
class Person:
    first: str
    last: str
    born: int
    died: int
    occupation: str
    male: bool
    birthplace: str = ""
    teacher: str = ""
    spouse: str = ""
    num_works: int = 0

    @property
    def name(self) -> str:
        return f"{self.first} {self.last}"


@dataclass
class Place:
    name: str
    kind: str
    region: str
    river: str
    bank: str
    founded: int
    founder: Person
    population: int
    industry: str
    neighbor: str
    direction: str
    distance_km: int
    landmark: str


def invent_names(rng: random.Random, count: int, endings: tuple[str, ...], taken: set[str]) -> list[str]:
    """`count` new capitalized words of two syllables plus an optional ending, none in `taken`."""
    names: list[str] = []
    while len(names) < count:
        word = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(2))
        word = (word + rng.choice(endings)).capitalize()
        if word not in taken and 4 <= len(word) <= 11:
            taken.add(word)
            names.append(word)
    return names


def number(n: int) -> str:
    """WikiText tokenization of an integer: 12400 -> '12 @,@ 400'."""
    return f"{n:,}".replace(",", " @,@ ")


def decimal(x: float) -> str:
    return f"{x:.1f}".replace(".", " @.@ ")


def build_world(rng: random.Random) -> tuple[list[Place], list[Person]]:
    """Invented people and places, linked to each other consistently."""
    taken: set[str] = set()
    firsts = invent_names(rng, 40, ("",), taken)
    lasts = invent_names(rng, 60, SURNAME_ENDINGS, taken)
    regions, rivers = invent_names(rng, 8, ("ia", "and"), taken), invent_names(rng, 12, ("",), taken)
    place_names = invent_names(rng, NUM_PLACES, PLACE_ENDINGS, taken)
    people, seen = [], set()
    while len(people) < NUM_PEOPLE:
        first, last = rng.choice(firsts), rng.choice(lasts)
        if (first, last) not in seen:
            seen.add((first, last))
            born = rng.randint(1700, 1830)
            people.append(Person(first, last, born, born + rng.randint(35, 88), rng.choice(OCCUPATIONS),
                                 rng.random() < 0.5))
    places = []
    for name in place_names:
        kind = rng.choice(KINDS)
        places.append(Place(name, kind, rng.choice(regions), rng.choice(rivers), rng.choice(("east", "west")),
                            rng.randint(1550, 1750), rng.choice(people), rng.randint(*POPULATIONS[kind]) // 100 * 100,
                            rng.choice(INDUSTRIES), rng.choice(place_names), rng.choice(DIRECTIONS),
                            rng.randint(3, 90), rng.choice(LANDMARKS)))
    for person in people:
        person.birthplace = rng.choice(place_names)
        person.teacher = rng.choice(people).name
        person.spouse = f"{rng.choice(firsts)} {rng.choice(lasts)}"
        person.num_works = rng.randint(3, 60)
    return places, people


PLACE_SECTIONS = {
    "": ("{name} is {adj} {kind} in the {region} region , on the {bank} bank of the {river} River .",
         "It lies about {km} km ( {mi} mi ) {direction} of {neighbor} .",
         "As of {census} , the {kind} had a population of {population} .",
         "The economy of {name} is based on {industry} .",
         "{name} is known for its {landmark} ."),
    "History": ("{name} was founded in {founded} by {founder} .",
                "In {bridge_year} , a stone bridge was built across the {river} River at {name} .",
                "The {kind} grew during the {century} century , when {industry} became important .",
                "On {fire_day} {fire_month} {fire_year} , a fire destroyed much of the old {kind} .",
                "By {growth_year} the population of {name} had reached {smaller} .",
                "The first church in {name} was completed in {church_year} .",
                "In {attack_year} , {name} was attacked by an army from {neighbor} .",
                "The {landmark} of {name} was built in {landmark_year} .",
                "{founder} is buried in the old church of {name} ."),
    "Geography": ("{name} lies on the {bank} bank of the {river} River .",
                  "The {kind} is {km} km ( {mi} mi ) {direction} of {neighbor} .",
                  "The land around {name} is {terrain} , and the climate is {climate} .",
                  "The highest point near the {kind} rises to {height} m .",
                  "The {river} River flows through {name} from the {direction} .",
                  "In winter the {river} River often freezes near {name} ."),
    "Economy": ("The main industry of {name} is {industry} .",
                "In {census} , about {percent} % of the people of {name} worked in {industry} .",
                "A market has been held in {name} every {weekday} since {founded} .",
                "Trade with {neighbor} grew after a road was built in {road_year} .",
                "The {kind} also produces {product} , which is sold in {neighbor} .",
                "A bank was opened in {name} in {bank_year} ."),
    "Culture": ("The {landmark} is the best known building in {name} .",
                "A festival is held in {name} every {festival_month} .",
                "The museum of {name} was opened in {museum_year} and holds works by {founder} .",
                "The people of {name} speak a dialect of the {region} language .",
                "{name} has {schools} schools and a library ."),
}
PERSON_SECTIONS = {
    "": ("{name} ( {day} {month} {born} – {died} ) was a {nationality} {occupation} .",
         "{pronoun} is best known for {possessive} {works} .",
         "{first} was born in {birthplace} and died at the age of {age} .",
         "{pronoun} was a student of {teacher} ."),
    "Early life": ("{first} was born on {day} {month} {born} in {birthplace} , {kind_a} in the {region} region .",
                   "{possessive_cap} father was a {father} and {possessive} mother was a {mother} .",
                   "At the age of {young} , {first} moved to {neighbor} to study under {teacher} .",
                   "{pronoun} spent {possessive} early years in {birthplace} .",
                   "{first} had {siblings} brothers and sisters .",
                   "As a child , {first} showed great interest in {interest} ."),
    "Career": ("In {career_year} , {first} became {occupation_a} in {neighbor} .",
               "Over {possessive} life , {last} made {num_works} {works} .",
               "{possessive_cap} first major work was completed in {first_work_year} .",
               "{last} worked with {teacher} for {years} years .",
               "In {travel_year} , {pronoun_low} travelled to {place} , where {pronoun_low} stayed for {years} years .",
               "{last} was paid {money} pounds for {possessive} work in {place} .",
               "In {elected_year} , {last} was elected to the academy of {region} ."),
    "Personal life": ("In {married_year} , {first} married {spouse} .",
                      "They had {children} children and lived in {place} .",
                      "{last} was a close friend of {friend} .",
                      "{pronoun} spoke {languages} languages ."),
    "Death and legacy": ("{first} {last} died in {deathplace} in {died} , at the age of {age} .",
                         "{pronoun} was buried in {birthplace} .",
                         "A street in {birthplace} was named after {first} {last} in {street_year} .",
                         "{possessive_cap} {works} are kept in the museum of {place} .",
                         "{possessive_cap} student {friend} continued {possessive} work ."),
}


def a_or_an(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def years(rng: random.Random, first: int, last: int, names: tuple[str, ...]) -> dict[str, str]:
    """One fixed year in [first, last] per named event of an entity."""
    return {f"{name}_year": str(rng.randint(first, max(first, last))) for name in names}


def place_slots(rng: random.Random, p: Place) -> dict[str, str]:
    """Every slot of a place's article, fixed for the whole article so that its facts agree."""
    slots = years(rng, p.founded + 10, 1890, ("bridge", "fire", "growth", "church", "attack", "landmark", "road",
                                               "bank", "museum"))
    century = int(slots["growth_year"]) // 100 - 15
    return slots | {
        "name": p.name, "adj": a_or_an(rng.choice(ADJECTIVES)), "kind": p.kind, "region": p.region,
        "river": p.river, "bank": p.bank, "km": str(p.distance_km), "mi": str(round(p.distance_km * 0.621)),
        "direction": p.direction, "neighbor": p.neighbor, "census": str(rng.choice((1850, 1870, 1890))),
        "population": number(p.population), "smaller": number(p.population // rng.randint(2, 9) // 100 * 100),
        "industry": p.industry, "founded": str(p.founded), "founder": p.founder.name,
        "century": ("sixteenth", "seventeenth", "eighteenth", "nineteenth")[min(3, max(0, century))],
        "fire_day": str(rng.randint(1, 28)), "fire_month": rng.choice(MONTHS), "percent": decimal(rng.uniform(5, 70)),
        "terrain": rng.choice(("flat", "hilly", "marshy", "forested", "rocky")),
        "climate": rng.choice(("mild", "cold", "wet", "dry")), "height": number(rng.randint(4, 180) * 10),
        "weekday": rng.choice(("Monday", "Thursday", "Saturday")), "landmark": p.landmark,
        "product": rng.choice(("cloth", "beer", "salt", "iron", "cheese", "glass", "rope")),
        "schools": str(rng.randint(2, 30)), "festival_month": rng.choice(MONTHS)}


def person_slots(rng: random.Random, p: Person, places: dict[str, Place], people: list[Person]) -> dict[str, str]:
    """Every slot of a person's article, fixed for the whole article so that its facts agree."""
    home = places[p.birthplace]
    pronoun, possessive = ("He", "his") if p.male else ("She", "her")
    slots = years(rng, p.born + 18, p.died, ("career", "first_work", "travel", "elected", "married"))
    return slots | years(rng, p.died + 5, p.died + 60, ("street",)) | {
        "name": p.name, "first": p.first, "last": p.last, "born": str(p.born), "died": str(p.died),
        "age": str(p.died - p.born), "occupation": p.occupation, "occupation_a": a_or_an(p.occupation),
        "works": WORKS[p.occupation], "birthplace": p.birthplace, "kind_a": a_or_an(home.kind),
        "region": home.region, "neighbor": home.neighbor, "teacher": p.teacher, "num_works": str(p.num_works),
        "pronoun": pronoun, "pronoun_low": pronoun.lower(), "possessive": possessive,
        "possessive_cap": possessive.capitalize(),
        "nationality": home.region + ("n" if home.region.endswith("ia") else "ish"),
        "day": str(rng.randint(1, 28)), "month": rng.choice(MONTHS), "young": str(rng.randint(12, 19)),
        "father": rng.choice(OCCUPATIONS), "mother": rng.choice(("weaver", "teacher", "singer", "merchant")),
        "years": str(rng.randint(2, 12)), "place": rng.choice(list(places)),
        "deathplace": rng.choice((p.birthplace, home.neighbor)), "siblings": str(rng.randint(2, 9)),
        "children": str(rng.randint(2, 9)), "money": number(rng.randint(2, 90) * 50), "spouse": p.spouse,
        "interest": rng.choice(("music", "drawing", "numbers", "the stars", "machines", "books")),
        "friend": rng.choice(people).name, "languages": str(rng.randint(2, 6))}


def write_article(rng: random.Random, title: str, sections: dict[str, tuple[str, ...]],
                  slots: dict[str, str]) -> list[str]:
    """Lines of one article: title, lead paragraph, then sections of 1-3 paragraphs each.

    A paragraph opens with its section's first template, then draws 3-6 others without repetition.
    """
    lines = [" ", f" = {title} = ", " "]
    for heading, templates in sections.items():
        if heading:
            lines += [f" = = {heading} = = ", " "]
        for _ in range(1 if not heading else rng.randint(1, 3)):
            rest = rng.sample(templates[1:], min(len(templates) - 1, rng.randint(3, 6)))
            lines += [" " + " ".join(t.format_map(slots) for t in [templates[0], *rest]) + " ", " "]
    return lines


def generate(folder: Path, seed: int = 0) -> None:
    """Write the three split files into `folder` (which must exist)."""
    rng = random.Random(seed)
    places, people = build_world(rng)
    by_name = {p.name: p for p in places}
    articles = [(p.name, PLACE_SECTIONS, place_slots(rng, p)) for p in places]
    articles += [(p.name, PERSON_SECTIONS, person_slots(rng, p, by_name, people)) for p in people]
    rng.shuffle(articles)
    splits: dict[str, list[str]] = {name: [] for name in FILES}
    for i, (title, sections, slots) in enumerate(articles):
        split = FILES[1] if i % 12 == 5 else FILES[2] if i % 12 == 11 else FILES[0]
        splits[split] += write_article(rng, title, sections, slots)
    for name, lines in splits.items():
        (folder / name).write_text("\n".join(lines) + "\n", encoding="utf-8")


def is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in FILES)


def foreign_folder(folder: Path) -> ConfigError:
    return ConfigError(f"{folder} exists but does not hold the sample corpus ({', '.join(FILES)})", "data.root",
                       "point data.root at a new or empty folder, or leave it unset (the user cache)")


def default_sample_dir(seed: int = 0) -> Path:
    """The user cache's wikitext_sample_v<VERSION>[_seed<seed>]."""
    return user_cache_dir() / (f"wikitext_sample_v{VERSION}" + (f"_seed{seed}" if seed else ""))


def ensure_sample_corpus(root: str | Path | None = None, seed: int = 0) -> Path:
    """Generate the sample corpus at `root` (default: the user cache) unless it is already there.

    Written to a temporary folder and renamed into place, so concurrent ranks never see half a corpus;
    when two processes race, the first rename wins and the other copy is discarded (they are identical).
    Returns the folder holding the three files.
    """
    folder = Path(root).expanduser() if root else default_sample_dir(seed)
    if is_complete(folder):
        return folder
    if folder.is_dir() and any(folder.iterdir()) and not is_complete(folder):  # (re-check: a racing rename)
        raise foreign_folder(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".wikitext_sample-", dir=folder.parent))
    try:
        (tmp / "data").mkdir()
        generate(tmp / "data", seed)
        try:
            os.rename(tmp / "data", folder)  # replaces an empty folder, fails on a non-empty one
        except OSError:
            if not is_complete(folder):  # not a lost race: the folder holds something else
                raise foreign_folder(folder) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
