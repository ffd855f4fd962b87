"""The synthetic QA world: a closed vocabulary, entity-relation-value facts and the
seeded generator of one question with its gold and distractor passages.

``synthetic_qa.py`` turns worlds into encoded examples and data modules (its
docstring describes the task); this module is the part that knows nothing of
tokens, batches or Lightning, apart from the word-level tokenizer it builds.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass

from bft_lightning.lm.llama_format import TextTokenizer

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
FACT_ORDERS = ("entity_first", "relation_first")
SPECIALS = (PAD, BOS, EOS)
STRUCTURE = ("the", "of", "is", ".", "what", "?", "Question", "Answer", ":", "|", "recall")
RELATIONS: dict[str, tuple[str, ...]] = {
    "color": ("red", "blue", "green", "amber", "violet", "black", "white", "grey", "pink",
            "teal", "gold", "olive", "navy", "ivory"),
    "city": ("paris", "rome", "oslo", "lima", "cairo", "delhi", "tokyo", "quito", "sofia",
            "perth", "dakar", "hanoi", "riga", "bern"),
    "job": ("baker", "pilot", "judge", "nurse", "miner", "tailor", "poet", "clerk", "smith",
            "farmer", "cook", "diver", "guard", "mason"),
    "pet": ("cat", "dog", "owl", "fox", "hare", "frog", "crow", "mole", "newt", "wolf", "lynx",
            "goat", "seal", "wren"),
    "food": ("rice", "bread", "soup", "plum", "corn", "fig", "bean", "pear", "kale", "lime",
            "nut", "yam", "oat", "leek"),
    "sport": ("chess", "golf", "polo", "judo", "rugby", "tennis", "squash", "rowing", "boxing",
            "skiing", "diving", "archery", "fencing", "karate"),
    "tool": ("saw", "drill", "axe", "rake", "hoe", "lathe", "awl", "file", "plane", "chisel",
            "wrench", "hammer", "anvil", "spade"),
    "gem": ("ruby", "opal", "jade", "onyx", "pearl", "topaz", "beryl", "agate", "garnet",
            "quartz", "amber_stone", "coral", "jet", "zircon"),
}  # fmt: skip
_SYLLABLES = ("ba", "ko", "ri", "tu", "me", "sa", "lo", "ni", "da", "ve", "zu", "fi", "go", "pe")


def entity_names(n: int) -> list[str]:
    """``n`` distinct two-syllable pseudo-names (``bako``, ``bari``, ...), in a fixed order."""
    names = [a + b for a in _SYLLABLES for b in _SYLLABLES if a != b]
    if n > len(names):
        raise ValueError(f"num_entities={n} exceeds the {len(names)} names available")
    return names[:n]


def build_vocabulary(num_entities: int) -> list[str]:
    """Specials (ids 0, 1, 2: pad, BOS, EOS), structure words, relations, values, entities."""
    words = list(SPECIALS) + list(STRUCTURE) + list(RELATIONS)
    for values in RELATIONS.values():
        words += list(values)
    words += entity_names(num_entities)
    if len(set(words)) != len(words):
        raise AssertionError("the synthetic vocabulary has a repeated word")
    return words


def word_tokenizer(words: Sequence[str]) -> TextTokenizer:
    """A closed word-level tokenizer (one id per word, split on whitespace)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens(list(SPECIALS))
    return TextTokenizer(tok, vocab[BOS], vocab[EOS], vocab[PAD], None)


@dataclass
class Fact:
    entity: str
    relation: str
    value: tuple[str, ...]

    def words(self, order: str = "entity_first") -> list[str]:
        """``<entity> <relation> <value> .`` (``entity_first``) or ``<relation> <entity> ...``."""
        head = [self.entity, self.relation]
        return [*(head if order == "entity_first" else head[::-1]), *self.value, "."]


@dataclass
class SyntheticWorld:
    """One generated question: its gold passage, distractor passages and answer."""

    id: str
    entity: str
    relation: str
    answer: tuple[str, ...]
    gold: list[Fact]
    distractors: list[list[Fact]]  # max_distractors passages, used in order
    gold_slot: list[int]  # the gold passage's position among the first k distractors, per k

    def passages(self, k: int) -> tuple[list[list[Fact]], int]:
        """The gold passage among the first ``k`` distractors, and its position."""
        out = list(self.distractors[:k])
        pos = self.gold_slot[k]
        out.insert(pos, self.gold)
        return out, pos

    def question_words(self) -> list[str]:
        return ["Question", ":", "what", "is", "the", self.relation, "of", self.entity, "?"]


def _rng(*key: int | str) -> random.Random:
    """A random stream fixed by ``key`` alone (Python's Mersenne Twister: fast small draws)."""
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()
    return random.Random(int(digest[:32], 16))


def _value(rng: random.Random, relation: str, max_words: int) -> tuple[str, ...]:
    return tuple(rng.sample(RELATIONS[relation], rng.randint(1, max_words)))


def generate_world(
    rng: random.Random,
    qid: str,
    entities: Sequence[str],
    facts_per_passage: int,
    max_distractors: int,
    max_value_words: int,
) -> SyntheticWorld:
    """One question, its gold passage and ``max_distractors`` distractor passages."""
    relations = list(RELATIONS)
    who = rng.sample(range(len(entities)), 1 + max_distractors)
    entity = entities[who[0]]
    rels = rng.sample(relations, facts_per_passage)
    gold = [Fact(entity, r, _value(rng, r, max_value_words)) for r in rels]
    asked = gold[rng.randrange(len(gold))]
    distractors = []
    for j in who[1:]:
        other = [r for r in relations if r != asked.relation]
        pick = rng.sample(other, facts_per_passage - 1)
        while True:  # the asked relation with another value: only the entity tells it apart
            v = _value(rng, asked.relation, max_value_words)
            if v != asked.value:
                break
        facts = [Fact(entities[j], asked.relation, v)]
        facts += [Fact(entities[j], r, _value(rng, r, max_value_words)) for r in pick]
        distractors.append(rng.sample(facts, len(facts)))
    gold_slot = [rng.randint(0, k) for k in range(max_distractors + 1)]
    return SyntheticWorld(qid, entity, asked.relation, asked.value, gold, distractors, gold_slot)
