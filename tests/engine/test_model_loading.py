"""The real loading code on real folders: families, shards, tied weights, dtypes, bad folders."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model_dir
from reference import BATCH, GREEDY, assert_matches_hf
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kvmesh.engine import LLMEngine, SamplingParams

KVMESH = str(Path(sys.executable).with_name("kvmesh"))


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_identically(qwen3_dir, tmp_path):
    sharded = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, local_files_only=True, dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="300KB")
    for f in qwen3_dir.iterdir():
        if not f.name.startswith("model") and not (sharded / f.name).exists():
            shutil.copy(f, sharded / f.name)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a = LLMEngine(qwen3_dir, num_kv_blocks=128).generate(BATCH[:3], GREEDY)
    b = LLMEngine(sharded, num_kv_blocks=128).generate(BATCH[:3], GREEDY)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_tied_embeddings_match_transformers():
    tied = tiny_model_dir("llama", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(tied / "model.safetensors")
    outputs = LLMEngine(tied, num_kv_blocks=128).generate(BATCH[:4], GREEDY)
    assert_matches_hf(tied, BATCH[:4], outputs)


def test_dtype_defaults_and_override(qwen3_dir):
    assert LLMEngine(qwen3_dir, num_kv_blocks=16).runner.dtype == torch.float32
    bf16 = LLMEngine(qwen3_dir, num_kv_blocks=16, dtype="bfloat16")
    assert bf16.runner.model.lm_head.weight.dtype == torch.bfloat16
    assert bf16.runner.kv_cache.dtype == torch.bfloat16
    out = bf16.generate([BATCH[2]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLMEngine(qwen3_dir, num_kv_blocks=16, dtype="float8")


def test_kv_pool_sized_from_memory(qwen3_dir):
    engine = LLMEngine(qwen3_dir, kv_cache_memory=1 << 20, block_size=16)
    # 2 (k, v) x 2 layers x 16 tokens x 2 kv heads x 16 dims x 4 bytes = 8 KiB per block
    assert engine.block_manager.num_blocks == (1 << 20) // (8 << 10)


def test_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLMEngine(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"no config\.json"):
        LLMEngine(tmp_path)


def test_unsupported_architecture(qwen3_dir, tmp_path):
    bad = copy_model(qwen3_dir, tmp_path / "m")
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["Qwen3MoeForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'Qwen3MoeForCausalLM'"):
        LLMEngine(bad)


def test_missing_and_misshapen_tensors(qwen3_dir, tmp_path):
    bad = copy_model(qwen3_dir, tmp_path / "m")
    weights = load_file(bad / "model.safetensors")
    missing = dict(weights)
    del missing["model.layers.1.self_attn.k_proj.weight"]
    save_file(missing, bad / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors.*layers\.1\.self_attn\.qkv_proj\.weight"):
        LLMEngine(bad, num_kv_blocks=4)
    wrong = dict(weights)
    wrong["model.norm.weight"] = torch.ones(3)
    save_file(wrong, bad / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape"):
        LLMEngine(bad, num_kv_blocks=4)
    (bad / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        LLMEngine(bad, num_kv_blocks=4)


@pytest.mark.slow  # a subprocess that imports torch and Ray: make test-fast leaves it out
def test_make_tiny_model_cli_loads_offline(tmp_path):
    out = tmp_path / "tiny"
    run = subprocess.run(
        [
            KVMESH,
            "make-tiny-model",
            str(out),
            "--arch",
            "llama",
            "--hidden",
            "32",
            "--layers",
            "1",
            "--seed",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    check = (
        "from transformers import AutoTokenizer, AutoModelForCausalLM;"
        f"t = AutoTokenizer.from_pretrained({str(out)!r});"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r});"
        "text = 'Prefix caches route requests. ünïcode'; assert t.decode(t.encode(text)) == text;"
        "chat = t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False, add_generation_prompt=True);"
        "assert chat == '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n', chat;"
        "assert m.config.hidden_size == 32 and m.config.num_hidden_layers == 1 and t.eos_token == '<|endoftext|>'"
    )
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr


@pytest.mark.slow  # a subprocess that imports torch: make test-fast leaves it out
def test_an_engine_is_freed_when_dropped_and_builds_without_torch_dynamo(qwen3_dir):
    """A process's first engine once initialised its embedding at random on the meta device,
    which imported torch._dynamo from inside the engine's constructor; that
    import's frames formed a reference cycle holding the engine, so ``del`` freed nothing
    (on a GPU: its KV pool) until the garbage collector ran. Both checked in a fresh process."""
    check = (
        "import gc, sys, weakref; gc.disable();"
        "from kvmesh.engine import LLMEngine;"
        f"engine = LLMEngine({str(qwen3_dir)!r}, num_kv_blocks=64, block_size=16);"
        "dropped = weakref.ref(engine); del engine;"
        "assert dropped() is None, 'the engine outlived del';"
        "assert 'torch._dynamo' not in sys.modules, 'building an engine imported torch._dynamo'"
    )
    res = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


@pytest.mark.parametrize(
    "args",
    [["--arch", "gpt2"], ["--hidden", "30"], ["--hidden", "0"]],
    ids=["bad-arch", "indivisible", "zero"],
)
def test_make_tiny_model_cli_bad_args(tmp_path, args):
    run = subprocess.run(
        [KVMESH, "make-tiny-model", str(tmp_path / "x"), *args], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2
    assert len(run.stderr.strip().splitlines()) == 1 and "error" in run.stderr


def test_every_dtype_name_the_config_accepts_is_one_the_loader_knows():
    from kvmesh.engine.config import DTYPE_NAMES
    from kvmesh.engine.models.loader import DTYPES

    assert set(DTYPE_NAMES) == set(DTYPES) | {"auto"}


def test_a_cached_tiny_model_is_built_once_under_its_lock(tmp_path):
    """Parallel test workers and benchmarks ask for the cache at once: a builder waits for
    the one holding the build lock, then finds the folder built and leaves it as it is."""
    import threading

    from kvmesh.engine.models.tiny_model import cached_tiny_model, make_tiny_model
    from kvmesh.serving.model_lock import lock_file, locked

    path = tmp_path / "cache" / "qwen3"
    path.parent.mkdir()
    with locked(lock_file(path, "build"), exclusive=True):
        waiter = threading.Thread(target=cached_tiny_model, args=(path,))
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive() and not path.exists()  # it waits for the holder
        make_tiny_model(path)  # the holder builds it
        built = path.stat().st_ino
    waiter.join(30)
    assert not waiter.is_alive() and path.stat().st_ino == built  # found built: not replaced
    assert sorted(p.name for p in path.parent.iterdir()) == [".qwen3.build.lock", "qwen3"]
