"""The "builtin" dataset: short children's stories from a small grammar, so the demo and the tests need
no download.

Each story walks the same stages (setting, problem, attempt, resolution, moral) with names, animals,
places, objects and feelings drawn from a seeded generator. The fixed arc and the pronoun agreement
give a tiny model structure to learn, so its loss falls clearly within a few hundred steps, while the
vocabulary keeps it from memorising a handful of sentences.
"""
from __future__ import annotations

import random

# Bumped whenever the grammar changes, so token caches built from older text are not reused.
CORPUS_VERSION = 1
DEFAULT_CORPUS_BYTES = 3_000_000

GIRLS = ("Lily", "Mia", "Sue", "Anna", "Zoe", "Emma", "Rosa", "Ella", "Nina", "Lucy", "Amy", "Kate",
         "Maya", "Sara", "Ivy", "June")
BOYS = ("Tom", "Ben", "Max", "Sam", "Leo", "Jack", "Tim", "Finn", "Noah", "Jake", "Owen", "Ravi",
        "Eli", "Hugo", "Omar", "Kai")
PRONOUNS = {
    "girl": {"he": "she", "him": "her", "his": "her", "He": "She", "His": "Her", "kid": "girl"},
    "boy": {"he": "he", "him": "him", "his": "his", "He": "He", "His": "His", "kid": "boy"},
}
ANIMALS = ("dog", "cat", "bunny", "bird", "frog", "bear", "duck", "fox", "mouse", "turtle", "puppy",
           "kitten", "owl", "squirrel")
ANIMAL_NAMES = ("Spot", "Mittens", "Hops", "Tweet", "Bruno", "Daisy", "Rusty", "Pip", "Shelly",
                "Buddy", "Coco", "Sunny", "Pepper", "Biscuit")
ADJECTIVES = ("little", "happy", "kind", "curious", "small", "brave", "shy", "funny", "clever", "gentle")
PLACES = ("park", "forest", "beach", "garden", "farm", "lake", "meadow", "playground", "hill", "town")
HOMES = ("in a small house near the {place}", "in a blue house by the {place}",
         "with {his} mom and dad near the {place}", "in a cozy home close to the {place}")
OBJECTS = ("red ball", "blue kite", "shiny key", "toy car", "teddy bear", "little boat", "yellow hat",
           "box of crayons", "drum", "paper crown", "green balloon", "wooden train", "storybook",
           "jump rope")
HIDING_SPOTS = ("a big rock", "the bushes", "a pile of leaves", "the old bench", "a tall tree",
                "the slide", "a flower pot", "the fence")
HAPPY = ("happy", "glad", "proud", "excited", "thankful")
SAD = ("sad", "upset", "worried", "scared", "lonely")
WEATHER = ("sunny", "warm", "bright", "windy", "cool")
FOODS = ("apples", "cookies", "sandwiches", "carrots", "berries", "cupcakes")

SETTINGS = (
    "Once upon a time, there was a {adj} {kid} named {name}. {He} lived {home}.",
    "Once upon a time, in a land far away, there lived a {adj} {kid} called {name}.",
    "There once was a {adj} {kid} named {name}. {He} lived {home}.",
    "One {weather} day, a {adj} {kid} named {name} woke up early.",
)
LIKES = (
    "{name} loved to play with {his} {object} every day.",
    "{His} favorite toy was a {object}. {He} took it everywhere.",
    "{name} had a {object} that {he} liked very much.",
)
FRIENDS = (
    "{name} had a friend, {a_animal} named {friend}.",
    "{His} best friend was {a_animal} called {friend}.",
    "{name} and {his} {animal}, {friend}, did everything together.",
)
OUTINGS = (
    "One day, {name} and {friend} went to the {place} to play.",
    "One {weather} morning, {name} took {his} {object} to the {place}.",
    "After lunch, {name} and {friend} walked to the {place}.",
)

# A story's middle: each kind of problem has its own attempts, resolutions and morals, so the moral is
# predictable from the problem a few hundred tokens earlier. attempt[i] leads to resolution[i].
PLOTS = {
    "lost": {
        "problem": (
            "But when {he} looked down, {his} {object} was gone! {name} felt very {sad}.",
            "Suddenly, {name} could not find {his} {object}. {He} looked everywhere, but it was gone.",
        ),
        "attempt": (
            '{friend} said, "Do not worry, {name}. I will help you look!" They looked behind {spot} '
            "and under {spot2}.",
            "{name} and {friend} searched near {spot}. Then they searched near {spot2}.",
        ),
        "resolution": (
            "At last, {friend} found the {object} under {spot2}. {name} was so {happy} that {he} gave "
            "{friend} a big hug.",
            'Then {name} saw something bright next to {spot2}. It was {his} {object}! "Thank you, '
            '{friend}," {he} said.',
        ),
        "moral": (
            "From that day on, {name} knew that good friends always help each other.",
            "{name} learned that a friend who helps you look is the best kind of friend.",
        ),
    },
    "stuck": {
        "problem": (
            "The wind blew hard, and {his} {object} got stuck high up in a tall tree.",
            "{name} threw {his} {object} too high, and it landed on the roof of the shed.",
        ),
        "attempt": (
            "{name} tried to jump, but {he} was too small. {He} felt {sad}. Then {friend} had an idea.",
            "{name} stretched and stretched, but {he} could not reach it. {friend} thought very hard.",
        ),
        "resolution": (
            "{friend} climbed up carefully and pushed the {object} down. {name} caught it and smiled.",
            "{friend} found a long stick, and together they knocked the {object} down. {name} was {happy}.",
        ),
        "moral": (
            "{name} learned that when you work together, you can do hard things.",
            "From then on, {name} always asked {his} friends for help when something was too hard.",
        ),
    },
    "share": {
        "problem": (
            "{friend} wanted to play with the {object} too, but {name} did not want to share.",
            '"Can I play with your {object}?" asked {friend}. "No, it is mine!" said {name}.',
        ),
        "attempt": (
            "{friend} felt {sad} and sat down alone. {name} played by {him}self, but it was not fun.",
            "{friend} walked away. Soon {name} felt {sad}, because playing alone was boring.",
        ),
        "resolution": (
            '{name} ran to {friend} and said, "I am sorry. Let us play together." They laughed and '
            "played all day.",
            "{name} gave the {object} to {friend} for a while. Then they took turns, and both were {happy}.",
        ),
        "moral": (
            "{name} learned that sharing makes playing more fun.",
            "From that day on, {name} always shared {his} toys with {his} friends.",
        ),
    },
    "scared": {
        "problem": (
            "Then the sky got dark, and there was a loud noise. {name} felt {sad} and wanted to go home.",
            "Near {spot}, {name} heard a strange sound. {He} was very {sad}.",
        ),
        "attempt": (
            '{friend} held {his} hand and said, "Let us be brave and look together."',
            '{name} took a deep breath. "I can be brave," {he} said, and {he} walked closer with {friend}.',
        ),
        "resolution": (
            "It was only a little {animal2} hiding behind {spot2}! {name} laughed, and the {animal2} "
            "became their new friend.",
            "It was just the wind in the trees. {name} smiled, and they played until the sun came out.",
        ),
        "moral": (
            "{name} learned that being brave is easier with a friend.",
            "From then on, {name} was not afraid of strange sounds anymore.",
        ),
    },
    "hungry": {
        "problem": (
            "After a long time of playing, {name} and {friend} were very hungry, but they had no food.",
            "{name} forgot {his} lunch at home, and {his} tummy began to rumble.",
        ),
        "attempt": (
            "{friend} said, \"I have some {food}. We can eat them together.\"",
            "{name} asked a kind old man near the {place} for something to eat.",
        ),
        "resolution": (
            "They sat under a tree and shared the {food}. Everything tasted very good.",
            "The man smiled and gave them some {food}. {name} said thank you, and they ate together.",
        ),
        "moral": (
            "{name} learned that sharing food with friends makes it taste even better.",
            "{name} learned that it is good to be kind and to say thank you.",
        ),
    },
}
ENDINGS = ("The end.", "", "And they lived happily ever after.", "")


def generate_stories(num_bytes: int, seed: int) -> list[str]:
    """Stories until their total length reaches `num_bytes`; the same list for the same seed."""
    rng = random.Random(seed)
    stories, total_bytes = [], 0
    plot_kinds = sorted(PLOTS)
    while total_bytes < num_bytes:
        story = _story(rng, PLOTS[rng.choice(plot_kinds)])
        stories.append(story)
        total_bytes += len(story)  # ASCII only: characters are bytes
    return stories


def _story(rng: random.Random, plot: dict) -> str:
    gender = rng.choice(("girl", "boy"))
    slots = dict(PRONOUNS[gender])
    slots.update(
        name=rng.choice(GIRLS if gender == "girl" else BOYS),
        adj=rng.choice(ADJECTIVES),
        animal=rng.choice(ANIMALS),
        animal2=rng.choice(ANIMALS),
        friend=rng.choice(ANIMAL_NAMES),
        place=rng.choice(PLACES),
        object=rng.choice(OBJECTS),
        weather=rng.choice(WEATHER),
        happy=rng.choice(HAPPY),
        sad=rng.choice(SAD),
        food=rng.choice(FOODS),
    )
    slots["spot"], slots["spot2"] = rng.sample(HIDING_SPOTS, 2)
    slots["a_animal"] = ("an " if slots["animal"][0] in "aeiou" else "a ") + slots["animal"]
    slots["home"] = rng.choice(HOMES).format_map(slots)
    branch = rng.randrange(len(plot["attempt"]))
    templates = [rng.choice(SETTINGS), rng.choice(LIKES), rng.choice(FRIENDS), rng.choice(OUTINGS),
                 rng.choice(plot["problem"]), plot["attempt"][branch], plot["resolution"][branch],
                 rng.choice(plot["moral"]), rng.choice(ENDINGS)]
    return " ".join(t.format_map(slots) for t in templates if t)
