"""Load a supported causal LM from a local Hugging Face folder (config + safetensors).

Never touches the hub: ``local_files_only`` everywhere. Errors name the folder and what is
wrong with it (missing, unsupported architecture, missing or misshapen tensors).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvmesh.engine.models.decoder import DecoderForCausalLM, DecoderSpec

# architecture -> (qkv bias default, q/k norm)
ARCHITECTURES = {
    "LlamaForCausalLM": ("attention_bias", False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": ("attention_bias", True),
}

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# checkpoint tensor suffix -> (our parameter suffix, shard index within the fused tensor)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_FUSED_RE = re.compile(
    r"^(model\.layers\.\d+\.)(" + "|".join(re.escape(k) for k in _FUSED) + r")\.(weight|bias)$"
)
_IGNORED_RE = re.compile(r"rotary_emb\.inv_freq$")


def load_hf_config(model_dir: str | Path) -> PretrainedConfig:
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"model folder {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise ValueError(f"model folder {str(path)!r} has no config.json")
    return AutoConfig.from_pretrained(path, local_files_only=True)


def decoder_spec(config: PretrainedConfig) -> DecoderSpec:
    arch = (config.architectures or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
    if getattr(config, "use_sliding_window", False):
        raise ValueError(f"{arch} with sliding-window attention is not supported")
    qkv_bias, qk_norm = ARCHITECTURES[arch]
    attention_bias = bool(getattr(config, "attention_bias", False))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq, scaling = _rope(config, head_dim)
    return DecoderSpec(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=attention_bias if qkv_bias == "attention_bias" else qkv_bias,
        o_bias=attention_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=qk_norm,
        inv_freq=inv_freq,
        attention_scaling=scaling,
    )


def _rope(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    if rope_type == "dynamic" or rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {rope_type!r} is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq, float(scaling)


def resolve_dtype(name: str | None, config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """An explicit name wins; else fp32 on CPU and the checkpoint's half type on CUDA."""
    if name not in (None, "auto"):
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}")
        return DTYPES[name]
    checkpoint = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(checkpoint, str):
        checkpoint = DTYPES.get(checkpoint)
    if name == "auto" and checkpoint is not None:
        return checkpoint
    if device.type == "cpu":
        return torch.float32
    return checkpoint if checkpoint in (torch.float16, torch.bfloat16) else torch.bfloat16


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"model folder {str(model_dir)!r} is missing shard(s) {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {str(model_dir)!r} has no *.safetensors weights")
    return files


def load_model(
    model_dir: str | Path, spec: DecoderSpec, dtype: torch.dtype, device: torch.device
) -> DecoderForCausalLM:
    with torch.device("meta"):
        model = DecoderForCausalLM(spec).to(dtype)
    model.to_empty(device=device)  # every parameter is then overwritten from the checkpoint
    model.rotary.inv_freq = spec.inv_freq.float().to(device)
    model.tie_weights()
    _load_weights(model, Path(model_dir))
    model.eval().requires_grad_(False)  # serving weights never need autograd
    model.fuse_weights()  # after: derived weights carry no autograd history
    return model


def _load_weights(model: DecoderForCausalLM, model_dir: Path) -> None:
    params = dict(model.named_parameters())  # a tied lm_head shows up once, as embed_tokens
    expected = {(name, shard) for name in params for shard in range(_shard_count(name))}
    loaded: set[tuple[str, int]] = set()
    unknown: list[str] = []
    for file in _weight_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if _IGNORED_RE.search(key) or (key == "lm_head.weight" and model.spec.tie_word_embeddings):
                    continue
                target = _target(key)
                if target is None or target[0] not in params:
                    unknown.append(key)
                    continue
                name, shard = target
                _copy_shard(params[name], name, shard, f.get_tensor(key), model.spec, key)
                loaded.add((name, shard))
    if unknown:
        raise ValueError(f"checkpoint has tensors this architecture does not use: {unknown[:5]}")
    missing = sorted({name for name, _ in expected - loaded})
    if missing:
        raise ValueError(f"checkpoint in {str(model_dir)!r} is missing tensors for: {missing[:5]}")


def _shard_count(name: str) -> int:
    return 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1


def _target(key: str) -> tuple[str, int] | None:
    m = _FUSED_RE.match(key)
    if m:
        prefix, part, kind = m.groups()
        fused, shard = _FUSED[part]
        return f"{prefix}{fused}.{kind}", shard
    return key, 0


def _copy_shard(
    param: torch.Tensor, name: str, shard: int, tensor: torch.Tensor, spec: DecoderSpec, key: str
) -> None:
    if "qkv_proj" in name:
        sizes = [spec.num_heads * spec.head_dim] + [spec.num_kv_heads * spec.head_dim] * 2
    elif "gate_up_proj" in name:
        sizes = [spec.intermediate_size] * 2
    else:
        sizes = [param.shape[0]]
    start = sum(sizes[:shard])
    dest = param.data.narrow(0, start, sizes[shard])
    if dest.shape != tensor.shape:
        raise ValueError(f"tensor {key!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    with torch.no_grad():
        dest.copy_(tensor)
