"""``kvmesh make-tiny-model``: a small random model + trained tokenizer, fully offline.

Tests, benchmarks and the demo need a real Hugging Face folder (config.json, safetensors,
tokenizer files, generation_config.json) without any hub access. The weights are random
with a fixed seed; the tokenizer is a byte-level BPE trained on a generated corpus, so any
text round-trips. ``AutoTokenizer`` and ``AutoModelForCausalLM`` load the folder as is.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

from kvmesh.serving.model_lock import lock_file, locked

ARCHS = ("qwen3", "qwen2", "llama")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
    "has",
    "would",
    "when",
    "if",
    "so",
    "no",
    "will",
    "more",
    "can",
    "other",
    "its",
    "into",
    "time",
    "only",
    "new",
    "some",
    "could",
    "these",
    "two",
    "may",
    "first",
    "then",
    "do",
    "any",
    "like",
    "my",
    "now",
    "over",
    "such",
    "our",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
    "cache",
    "block",
    "prefix",
    "token",
    "router",
    "replica",
    "index",
    "request",
    "model",
    "serve",
    "batch",
    "queue",
    "memory",
    "stream",
    "hash",
    "chain",
    "latency",
    "throughput",
    "cluster",
    "node",
    "shard",
    "page",
    "kernel",
    "tensor",
    "attention",
    "decode",
    "prefill",
]


def _corpus(seed: int, sentences: int = 4000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ",", ":"]))
    return lines


def build_tokenizer(vocab_size: int, seed: int):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with eos, pad and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "qwen3",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab_size: int = 1024,
    max_position_embeddings: int = 4096,
    init_std: float = 0.1,
    seed: int = 0,
    tie_word_embeddings: bool = False,
) -> Path:
    """Write the model folder atomically (built in a temp folder, then renamed)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must divide by heads ({heads}), heads by kv_heads ({kv_heads})")
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen2Config, Qwen3Config
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(out_dir)
    tokenizer = build_tokenizer(vocab_size, seed)
    eos_ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate or 3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=eos_ids[0],
        pad_token_id=eos_ids[0],
    )
    config_cls = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    arch_name = {"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama"}[arch]
    config = config_cls(architectures=[f"{arch_name}ForCausalLM"], **common)
    if arch != "qwen2":  # Qwen2 derives head_dim from hidden / heads
        config.head_dim = hidden // heads
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=eos_ids[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def cached_tiny_model(path: str | Path, **settings) -> Path:
    """The tiny model at ``path``, built there the first time (``make_tiny_model``'s
    settings): the demo's, the benchmarks' and the tests' cache. Built under a lock, so
    processes asking at once (parallel test workers, two benchmarks) build it once and never
    replace a folder another is reading."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with locked(lock_file(path, "build"), exclusive=True):
        if not (path / "config.json").is_file():
            make_tiny_model(path, **settings)
    return path
