"""Self-instruct: the target writes questions and tasks from seed topics, then answers them.

Corpus prompts all look alike (summarize this passage, continue this text, complete this function); what
users type is short, varied and open. So the target first writes a request from a seed (a topic and a
request style) at a high temperature, and the requests that read like one become training prompts of
their own. Both the request the target wrote and its answer are the target's text, so both train the
drafter. The topics are generic on purpose: none comes from a corpus passage, so none shares text with
the held-out prompts.
"""

from __future__ import annotations

import random
import re

from specdec_training.separation import normalized_hash

TOPICS = (
    "volcanoes", "the water cycle", "photosynthesis", "black holes", "the French Revolution", "the Roman Empire",
    "ancient Egypt", "the printing press", "electric cars", "solar panels", "wind turbines", "climate change",
    "coral reefs", "honey bees", "the human heart", "sleep", "vaccines", "antibiotics", "DNA", "evolution",
    "plate tectonics", "earthquakes", "the Moon", "Mars", "the speed of light", "gravity", "magnetism",
    "electricity", "batteries", "the internet", "email", "passwords", "encryption", "databases", "spreadsheets",
    "recursion", "sorting algorithms", "binary search", "hash tables", "linked lists", "regular expressions",
    "unit testing", "version control with git", "HTTP", "JSON", "CSV files", "Python dictionaries",
    "Python list comprehensions", "Python classes", "exceptions in Python", "reading files in Python",
    "SQL joins", "shell scripts", "Linux processes", "memory leaks", "caching", "compilers", "operating systems",
    "machine learning", "neural networks", "probability", "prime numbers", "fractions", "percentages",
    "geometry", "the Pythagorean theorem", "statistics", "budgeting", "saving money", "interest rates",
    "inflation", "supply and demand", "starting a small business", "writing a resume", "job interviews",
    "public speaking", "learning a language", "studying for exams", "time management", "friendship",
    "kindness", "gardening", "composting", "houseplants", "baking bread", "making soup", "healthy breakfasts",
    "coffee", "tea", "chocolate", "cooking rice", "vegetarian meals", "running", "swimming", "yoga",
    "chess", "football", "the Olympic Games", "music theory", "the piano", "jazz", "painting", "photography",
    "poetry", "fairy tales", "detective stories", "science fiction", "libraries", "museums", "maps",
    "mountains", "rivers", "deserts", "rainforests", "the Arctic", "oceans", "whales", "dolphins", "elephants",
    "cats", "dogs", "birds", "butterflies", "dinosaurs", "fossils", "the seasons", "weather forecasts",
    "clouds", "rainbows", "trains", "airplanes", "bicycles", "bridges", "castles", "lighthouses", "pirates",
    "knights", "the Silk Road", "the Renaissance", "Shakespeare's plays", "Greek myths", "the Bible's parables",
    "moving to a new city", "recycling", "cleaning a kitchen", "fixing a flat tire", "first aid", "camping",
)  # fmt: skip
STYLES = (
    ("instruction", "Write one question that a curious person might ask about {topic}."),
    ("instruction", "Write one request asking an assistant to explain {topic} to a beginner."),
    ("instruction", "Write one instruction asking for a list of tips about {topic}."),
    ("instruction", "Write one request for a short story about {topic}."),
    ("instruction", "Write one request for a short poem about {topic}."),
    ("instruction", "Write one question comparing two things related to {topic}."),
    ("instruction", "Write one request for a step-by-step guide related to {topic}."),
    ("prose", "Write one request asking for a short essay about {topic}."),
    ("code", "Write one small Python programming task related to {topic}."),
    ("code", "Write one request asking for a Python function that helps with {topic}."),
)
ONLY = " Reply with the request only, in one or two sentences, and nothing else."
MIN_CHARS, MAX_CHARS = 15, 400
LEAD_IN = re.compile(r"^\s*(?:\*\*)?(?:question|request|instruction|task|prompt)\s*\d*\s*:\s*(?:\*\*)?\s*", re.I)


def seed_requests(count: int, seed: int) -> list[tuple[str, str]]:
    """`count` (kind, text) requests for the target to write a prompt from: every topic in every style,
    shuffled and repeated as needed (the target writes each at a high temperature, so repeats differ)."""
    pairs = [(kind, style.format(topic=topic) + ONLY) for topic in TOPICS for kind, style in STYLES]
    rng = random.Random(f"{seed}:self-instruct")
    out: list[tuple[str, str]] = []
    while len(out) < count:
        rng.shuffle(pairs)
        out += pairs[: count - len(out)]
    return out


def parse_request(text: str) -> str | None:
    """The request the target wrote, cleaned; None when it does not read like one (too short or long, or a
    refusal that starts answering instead)."""
    first = text.strip().split("\n\n", 1)[0].strip()
    first = LEAD_IN.sub("", first).strip().strip('"').strip("“”").strip()
    if not MIN_CHARS <= len(first) <= MAX_CHARS or first.lower().startswith(("sure", "certainly", "here is")):
        return None
    return first


def unique_requests(candidates: list[tuple[str, str | None]]) -> list[tuple[str, str]]:
    """(kind, request) for each parsed request, dropping failures and duplicates by normalized text."""
    seen: set[bytes] = set()
    out = []
    for kind, request in candidates:
        if request is None:
            continue
        digest = normalized_hash(request)
        if digest not in seen:
            seen.add(digest)
            out.append((kind, request))
    return out
