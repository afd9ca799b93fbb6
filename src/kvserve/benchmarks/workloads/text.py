"""Seeded text for benchmark prompts, generated on the spot (no downloads).

Two kinds of text, both reproducible from a seeded ``random.Random``:

- English: sentences written for kvserve, drawn with replacement into
  passages. Real English tokenizes like user text; because sentences recur,
  two prompts can open alike and share KV blocks under prefix caching.
- Prose: sentences built from a small vocabulary and grammar. It reads like
  plausible prose to a tokenizer (common words, punctuation, capitals) without
  meaning anything, and practically never repeats, so prompts share a prefix
  only where a benchmark puts one.

:mod:`kvserve.benchmarks.workloads.prompts` turns either into prompts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

# English: sentences written for kvserve.
SENTENCES = (
    "The river rose slowly through the night, and by morning the lower fields were under water.",
    "She kept a small notebook in her coat pocket and wrote down every bird she saw on her walks.",
    "Most bread is made from four things: flour, water, salt and yeast, plus a great deal of patience.",
    "The old lighthouse keeper climbed one hundred and twelve steps twice a day for thirty years.",
    "When the train stopped between stations, nobody spoke, and the carriage grew very quiet.",
    "A good map leaves out almost everything, which is exactly what makes it useful.",
    "The committee met on Tuesday to discuss the budget, but the meeting ran long and nothing was decided.",
    "Children learn to count on their fingers long before they understand what a number is.",
    "In winter the lake freezes so thick that people drive their cars across it to the island.",
    "He fixed the bicycle with a borrowed wrench, a piece of wire and more confidence than skill.",
    "The library opened at nine, and by ten every table near the windows was taken.",
    "Tomatoes were once thought to be poisonous in parts of Europe, and were grown only for decoration.",
    "The storm knocked out the power, so they cooked dinner on the camping stove in the kitchen.",
    "Every spring the swallows return to the same barn, often to the very same nest.",
    "A computer does exactly what it is told, which is the problem more often than the solution.",
    "The market sold cheese, honey, wool, and apples so crisp that they cracked when you bit them.",
    "Her grandmother could tell the weather from the colour of the evening sky over the hills.",
    "The bridge was built in eleven months, and it has carried traffic for more than a century.",
    "Good writing is mostly rewriting, and the first draft is only a way to find out what you think.",
    "The museum keeps its oldest maps in a cold, dark room, where the paper will last for centuries.",
    "After the rain, the streets smelled of wet stone, and the gutters ran with water for an hour.",
    "The team practised the same play forty times until every player could run it with closed eyes.",
    "An octopus has three hearts, blue blood, and a brain that reaches into each of its arms.",
    "The recipe said to stir gently, but he stirred hard, and the sauce split into oil and lumps.",
    "Mountains make their own weather, and a clear morning can turn to snow before lunch.",
    "The letter arrived forty years late, its stamp faded and its envelope soft as cloth.",
    "Small shops on the high street close one by one as people buy more of what they need online.",
    "The scientist repeated the experiment three times before she believed the surprising result.",
    "A cat will sleep for most of the day and then run through the house at midnight for no reason.",
    "The village held a fair every August, with a brass band, a cake contest and a tug of war.",
    "Language changes slowly, and words that sound old to us were once the newest slang in town.",
    "The ship's cook baked bread every morning, even when the sea was rough and the ovens swayed.",
    "To learn a new skill, practise a little every day rather than a lot once a week.",
    "The garden was wild and overgrown, but in June it filled with roses, foxgloves and bees.",
    "Engineers test a new aircraft wing by bending it until it breaks, far beyond any real flight.",
    "The teacher asked a simple question, and the whole class went silent, each hoping not to be chosen.",
    "Coffee reached Europe in the seventeenth century, and coffee houses soon became places to argue.",
    "The path along the cliff is narrow, and on windy days the rangers close it to walkers.",
    "A clock that is stopped is right twice a day, which is more than can be said for some forecasts.",
    "The orchestra tuned for a full minute, then the hall went dark and the first notes rose softly.",
)


def passage(rng: random.Random, num_sentences: int) -> str:
    """``num_sentences`` sentences drawn with replacement, joined into one paragraph."""
    return " ".join(rng.choice(SENTENCES) for _ in range(num_sentences))


# Prose: clauses of a noun phrase, a verb and another noun phrase (adverb and
# prepositional phrase optional), each word drawn from the lists below.
def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_DETERMINERS = _words("the a this that every each some no one another")
_ADJECTIVES = _words(
    "small large quiet bright old new early late simple careful quick slow warm cold "
    "clear dark heavy light open narrow wide busy empty green blue red golden silver "
    "strange familiar useful patient honest curious gentle loud sudden distant local "
    "modern ancient rough smooth tired eager"
)
_NOUNS = _words(
    "engine river garden window teacher student city village road bridge market "
    "question answer letter story book table kitchen mountain forest ocean island "
    "machine computer program model memory block cache request server client doctor "
    "farmer painter musician child family friend neighbour storm morning evening "
    "winter summer season light shadow voice idea plan problem reason result moment "
    "door wall field station train ship planet star paper pencil lamp clock"
)
_VERBS = _words(
    "finds builds opens carries watches follows answers writes reads remembers "
    "forgets explains measures paints repairs visits crosses leaves joins keeps "
    "changes moves checks holds shares counts sends receives describes improves "
    "protects discovers collects teaches learns"
)
_ADVERBS = _words(
    "slowly quickly quietly carefully often rarely always suddenly gently clearly "
    "again together later soon nearly almost"
)
_PREPOSITIONS = _words("near behind under over beside across through around toward after before")
_CONNECTIVES = _words("and but so because while although when")


def _choice(rng: random.Random, words: Sequence[str]) -> str:
    return words[rng.randrange(len(words))]


def _noun_phrase(rng: random.Random) -> str:
    words = [_choice(rng, _DETERMINERS)]
    if rng.random() < 0.6:
        words.append(_choice(rng, _ADJECTIVES))
    words.append(_choice(rng, _NOUNS))
    return " ".join(words)


def _clause(rng: random.Random) -> str:
    words = [_noun_phrase(rng)]
    if rng.random() < 0.3:
        words.append(_choice(rng, _ADVERBS))
    words += [_choice(rng, _VERBS), _noun_phrase(rng)]
    if rng.random() < 0.5:
        words += [_choice(rng, _PREPOSITIONS), _noun_phrase(rng)]
    return " ".join(words)


def random_sentence(rng: random.Random) -> str:
    """One sentence of one or two clauses, capitalised, ending in a full stop."""
    sentence = _clause(rng)
    if rng.random() < 0.4:
        sentence += f", {_choice(rng, _CONNECTIVES)} {_clause(rng)}"
    return sentence[0].upper() + sentence[1:] + "."


def random_text(rng: random.Random, num_sentences: int) -> str:
    """``num_sentences`` sentences in paragraphs of three to six."""
    paragraphs: list[str] = []
    remaining = num_sentences
    while remaining > 0:
        count = min(remaining, rng.randint(3, 6))
        paragraphs.append(" ".join(random_sentence(rng) for _ in range(count)))
        remaining -= count
    return "\n\n".join(paragraphs)


def random_words(rng: random.Random, num_words: int) -> str:
    """Exactly ``num_words`` words of seeded prose, on one line; the last sentence may be cut.

    For clients that have no tokenizer (``kvserve bench serve`` measures other
    servers too), where a prompt's length can only be asked for in words.
    """
    if num_words < 1:
        raise ValueError(f"num_words must be >= 1, got {num_words}")
    words: list[str] = []
    while len(words) < num_words:
        words += random_sentence(rng).split()
    return " ".join(words[:num_words])
