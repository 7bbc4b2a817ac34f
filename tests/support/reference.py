"""transformers as the reference implementation, for the parity tests."""

import functools

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from kvmesh.engine import SamplingParams

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@functools.cache
def _hf_model(model_dir: str):
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the reference ignores eos, like GREEDY
    return model


@functools.cache
def hf_log_softmax(model_dir: str, ids: tuple[int, ...]) -> torch.Tensor:
    """Row i: the model's log-probabilities for the token after ``ids[: i + 1]`` (fp32)."""
    with torch.inference_mode():
        logits = _hf_model(model_dir)(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(dim=-1)


def hf_greedy(model_dir, prompt_ids: list[int], n: int = MAX_NEW) -> list[int]:
    config = GenerationConfig(do_sample=False, max_new_tokens=n, pad_token_id=0)
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        return (
            _hf_model(str(model_dir)).generate(ids, generation_config=config)[0, len(prompt_ids) :].tolist()
        )


def prompts_of_lengths(lengths: list[int], vocab: int = 1000, salt: int = 0) -> list[list[int]]:
    return [[(7 * i + 13 * j + salt) % (vocab - 3) + 3 for j in range(n)] for i, n in enumerate(lengths)]


BATCH = prompts_of_lengths([3, 17, 33, 50, 64, 95, 128, 200])


def assert_matches_hf(model_dir, prompts, outputs, n=MAX_NEW):
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(model_dir, prompt, n), f"prompt of {len(prompt)} tokens diverged"
