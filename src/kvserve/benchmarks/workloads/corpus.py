"""English text for benchmark prompts, shipped with the package (no downloads).

The sentences below were written for kvserve. A seeded sampler strings them
into passages, so a workload is reproducible from its seed, and prompts are
real English that tokenizes like user text, not random token ids.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

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


def prompt_token_ids(
    tokenizer: PreTrainedTokenizerBase, rng: random.Random, num_tokens: int
) -> list[int]:
    """Exactly ``num_tokens`` token ids of English text (a passage, cut to length)."""
    token_ids: list[int] = []
    while len(token_ids) < num_tokens:
        token_ids.extend(tokenizer.encode(passage(rng, 8), add_special_tokens=False))
    return token_ids[:num_tokens]


def prompts_of_lengths(
    tokenizer: PreTrainedTokenizerBase, lengths: Sequence[int], seed: int
) -> list[list[int]]:
    """One prompt of each requested length, reproducible from ``seed``."""
    rng = random.Random(seed)
    return [prompt_token_ids(tokenizer, rng, n) for n in lengths]
