"""The segment cache tokenizes exactly as the whole text, for each tokenizer family it takes,
and refuses the ones it cannot cut."""

from __future__ import annotations

import random
import threading

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from kvmesh.serving.segment_cache import SEGMENT_CHARS, SegmentCache, cut, segmentable
from kvmesh.serving.tokenizer import PromptTokenizer

QWEN_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = QWEN_SPLIT.replace(r"\p{N}|", r"\p{N}{1,3}|")
SPECIALS = ["<|im_start|>", "<|im_end|>", "<bos>"]
# What random texts are made of: words, digits, punctuation, every kind of whitespace, accents
# composed and not (NFC's work), other scripts, special tokens, and cut points' near misses.
PIECES = (
    [
        "the",
        "The",
        "cat",
        "Zebra",
        "x",
        "déjà",
        "e\u0301",
        "Ä",
        "Ω",
        "日本語",
        "мир",
        "'s",
        "'ll",
        "42",
        "2026",
    ]
    + [" ", "  ", "\n", "\n\n", "\t", " \n", "\r\n", "\u00a0", "\u2003"]
    + [".", ",", "!", "?", "...", '"', "(", ")", "-", "'", "«", "—"]
    + SPECIALS[:2]
)


def _corpus(rng: random.Random) -> list[str]:
    return ["".join(rng.choice(PIECES) for _ in range(200)) for _ in range(200)]


def _trained(pre_tokenizer, normalizer=None, post_processor=None, **bpe) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(**bpe))
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=SPECIALS
    )
    tokenizer.train_from_iterator(_corpus(random.Random(0)), trainer)
    if post_processor is not None:
        tokenizer.post_processor = post_processor(tokenizer)
    return tokenizer


def _split_byte_level(pattern: str):
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _with_bos(tokenizer: Tokenizer):
    bos = tokenizer.token_to_id("<bos>")
    return processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])


FAMILIES = {
    "gpt2 byte-level": lambda: _trained(pre_tokenizers.ByteLevel(add_prefix_space=False)),
    "qwen: NFC + split": lambda: _trained(_split_byte_level(QWEN_SPLIT), normalizers.NFC()),
    "llama 3: split + BOS": lambda: _trained(_split_byte_level(LLAMA3_SPLIT), post_processor=_with_bos),
}


def _texts(rng: random.Random, count: int) -> list[str]:
    """Texts in groups that share long prefixes, with each piece kind and many cut points."""
    words = PIECES + [" Word", " cat", "x Y", ". And", " a", "1 B"] * 6
    prefixes = ["".join(rng.choice(words) for _ in range(rng.randint(50, 400))) for _ in range(4)]
    return [
        rng.choice(prefixes) + "".join(rng.choice(words) for _ in range(rng.randint(0, 200)))
        for _ in range(count)
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_ids_are_the_whole_texts_ids(family):
    tokenizer = FAMILIES[family]()
    assert segmentable(tokenizer) is None
    cache = SegmentCache(tokenizer, 1 << 20)
    texts = _texts(random.Random(family), 120)
    assert sum(len(cut(t)) - 1 for t in texts) > 300  # the texts were cut, often
    for special in (True, False):
        for text in texts + texts:  # the second pass comes from the cache
            expected = tokenizer.encode(text, add_special_tokens=special).ids
            assert cache.encode(text, add_special_tokens=special) == expected, text
    assert len(cache) > 0


def test_a_shared_prefix_is_tokenized_once():
    tokenizer = FAMILIES["qwen: NFC + split"]()
    seen: list[str] = []

    class Recording:  # the real tokenizer, with what it was asked to tokenize written down
        def encode_batch_fast(self, texts, add_special_tokens):
            seen.extend(texts)
            return tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)

    cache = SegmentCache(tokenizer, 1 << 20)
    cache.tokenizer = Recording()
    prefix = " ".join(["Shared words of a long system prompt."] * 60)
    first, second = prefix + " First question?", prefix + " Second question, longer?"
    cache.encode(first, False)
    before = sum(map(len, seen))
    assert cache.encode(second, False) == tokenizer.encode(second, add_special_tokens=False).ids
    tokenized_again = sum(map(len, seen)) - before
    assert tokenized_again <= SEGMENT_CHARS + len(" Second question, longer?") + 40


def test_the_cache_stays_within_its_bytes_and_stays_exact():
    tokenizer = FAMILIES["gpt2 byte-level"]()
    cache = SegmentCache(tokenizer, 8 << 10)
    texts = _texts(random.Random(7), 60)
    for text in texts:
        assert cache.encode(text, False) == tokenizer.encode(text, add_special_tokens=False).ids
        assert cache.held_bytes <= 8 << 10
    assert 0 < len(cache) < sum(len(cut(t)) - 1 for t in texts)


def test_threads_share_the_cache():
    tokenizer = FAMILIES["llama 3: split + BOS"]()
    cache = SegmentCache(tokenizer, 16 << 10)  # small: threads evict each other's parts
    texts = _texts(random.Random(3), 80)
    wrong: list[str] = []

    def work(offset: int) -> None:
        for text in texts[offset:] + texts[:offset]:
            if cache.encode(text) != tokenizer.encode(text).ids:
                wrong.append(text)

    threads = [threading.Thread(target=work, args=(i * 20,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda: _trained(pre_tokenizers.Metaspace()), "pre-tokenizer"),
        (lambda: _trained(_split_byte_level(r"\w+|\s+|[^\w\s]+")), "pre-tokenizer"),
        (lambda: _trained(pre_tokenizers.ByteLevel(use_regex=False)), "pre-tokenizer"),
        (lambda: _trained(pre_tokenizers.ByteLevel(), normalizers.Lowercase()), "normalizer"),
        (lambda: _trained(pre_tokenizers.ByteLevel(), dropout=0.1), "model"),
    ],
)
def test_tokenizers_it_cannot_cut_are_refused(make, why):
    assert why in segmentable(make())


def test_added_tokens_that_hold_or_strip_whitespace_are_refused():
    from tokenizers import AddedToken

    spaced = FAMILIES["gpt2 byte-level"]()
    spaced.add_tokens(["New York"])
    assert "whitespace" in segmentable(spaced)
    stripping = FAMILIES["gpt2 byte-level"]()
    stripping.add_special_tokens([AddedToken("<sep>", rstrip=True)])
    assert "whitespace" in segmentable(stripping)


def test_the_prompt_tokenizer_caches_only_where_it_may(tmp_path):
    ok, refused = tmp_path / "ok", tmp_path / "refused"
    for folder, tokenizer in (
        (ok, FAMILIES["qwen: NFC + split"]()),
        (refused, _trained(pre_tokenizers.Metaspace())),
    ):
        folder.mkdir()
        tokenizer.save(str(folder / "tokenizer.json"))
    cached = PromptTokenizer(ok, cache_bytes=1 << 20)
    assert PromptTokenizer(refused, cache_bytes=1 << 20).segments is None
    assert PromptTokenizer(ok).segments is None  # off unless asked for
    text = " ".join(["A long shared prompt, cut in parts."] * 40)
    assert cached.encode(text) == cached.tokenizer.encode(text).ids
    assert len(cached.segments) > 0


def test_servers_cache_by_default_within_the_flags_bound(tmp_path):
    from kvmesh.serving.api_config import APIConfig

    FAMILIES["gpt2 byte-level"]().save(str(tmp_path / "tokenizer.json"))
    tokenizer = APIConfig().load_tokenizer(str(tmp_path))
    assert tokenizer.segments is not None and tokenizer.segments.max_bytes == 64 << 20
    assert APIConfig(tokenizer_cache_bytes=0).load_tokenizer(str(tmp_path)).segments is None
    with pytest.raises(ValueError, match="tokenizer_cache_bytes"):
        APIConfig(tokenizer_cache_bytes=-1)
