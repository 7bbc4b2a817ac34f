"""The host tier in kvmesh's engine: blocks that leave the device pool are kept in host memory
and come back from it, with the greedy tokens of a prefix computed from scratch."""

import pytest
from reference import prompts_of_lengths

from kvmesh.engine import LLMEngine, SamplingParams
from kvmesh.engine.config import GiB, available_memory, host_kv_gib
from kvmesh.kvcache import replay
from kvmesh.kvcache.events import HOST

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def engine_with_host(qwen3_dir, device_blocks: int, host_blocks: int, **options) -> LLMEngine:
    probe = LLMEngine(qwen3_dir, num_kv_blocks=1, block_size=BLOCK)
    gib = host_blocks * probe.runner.block_bytes / GiB
    return LLMEngine(
        qwen3_dir,
        num_kv_blocks=device_blocks,
        block_size=BLOCK,
        host_kv_gib=gib,
        check_invariants=True,
        **options,
    )


@pytest.fixture(scope="module")
def prompts():
    # a prompt of 5 lookable blocks and two others that push it out of an 8-block pool
    return prompts_of_lengths([5 * BLOCK + 3, 6 * BLOCK, 6 * BLOCK], salt=11)


def test_a_prefix_computed_found_on_the_device_and_restored_from_the_host_gives_one_answer(
    qwen3_dir, prompts
):
    cold = LLMEngine(qwen3_dir, num_kv_blocks=64, block_size=BLOCK).generate([prompts[0]], GREEDY)[0]
    engine = engine_with_host(qwen3_dir, device_blocks=8, host_blocks=32)
    first = engine.generate([prompts[0]], GREEDY)[0]
    on_device = engine.generate([prompts[0]], GREEDY)[0]
    engine.generate(prompts[1:], GREEDY)  # the first prompt's blocks leave the device
    assert not set(engine_hashes(engine, prompts[0])) & engine.block_manager.cached_hashes()
    restored = engine.generate([prompts[0]], GREEDY)[0]
    assert first.token_ids == on_device.token_ids == restored.token_ids == cold.token_ids
    assert (first.num_cached_tokens, on_device.num_cached_tokens) == (0, 5 * BLOCK)
    assert on_device.num_host_cached_tokens == 0
    assert restored.num_cached_tokens == 5 * BLOCK and restored.num_host_cached_tokens > 0
    host = engine.stats().host
    assert host.restored_blocks == restored.num_host_cached_tokens // BLOCK
    assert host.hit_tokens == restored.num_host_cached_tokens and host.restore_seconds > 0
    assert host.restore_block_s == pytest.approx(host.restore_seconds / host.restored_blocks)


def test_a_block_is_copied_to_the_host_once_and_the_events_say_what_it_holds(qwen3_dir, prompts):
    engine = engine_with_host(qwen3_dir, device_blocks=8, host_blocks=32)
    events, stores = [], []
    for _ in range(3):  # the same three prompts pass through the small pool again and again
        outs = [engine.generate([p], GREEDY)[0] for p in prompts]
        events += engine.drain_kv_events()
        stores.append(engine.block_manager.host.stores)
    host, pool = engine.runner.host_kv, engine.block_manager.host
    distinct = {h for p, o in zip(prompts, outs, strict=True) for h in engine_hashes(engine, p + o.token_ids)}
    assert host.offloaded == pool.stores <= len(distinct)
    assert stores[1] == stores[2] > 0  # a block already there is not copied again
    assert replay(events, medium=HOST) == pool.cached_hashes()
    assert replay(events) == engine.block_manager.cached_hashes()


def test_the_host_pool_never_holds_more_than_its_bytes(qwen3_dir, prompts):
    engine = engine_with_host(qwen3_dir, device_blocks=8, host_blocks=4)
    many = prompts_of_lengths([3 * BLOCK + 1] * 12, salt=5)
    engine.generate(many, GREEDY)
    pool, host = engine.block_manager.host, engine.runner.host_kv
    assert host.nbytes == 4 * engine.runner.block_bytes <= engine.config.host_kv_gib * GiB + 1
    assert pool.num_used_blocks == 4 and pool.evictions > 0
    again = engine.generate(many[-1:], GREEDY)[0]  # the last prompt's blocks are the newest there
    assert again.num_cached_tokens == 3 * BLOCK


def test_host_kv_gib_is_checked_and_off_by_default_on_the_cpu(qwen3_dir):
    assert LLMEngine(qwen3_dir, num_kv_blocks=8, block_size=BLOCK).runner.host_kv is None
    for bad in (-1, "2", 10**6):
        with pytest.raises(ValueError, match="host_kv_gib"):
            LLMEngine(qwen3_dir, num_kv_blocks=8, block_size=BLOCK, host_kv_gib=bad)


def engine_hashes(engine: LLMEngine, prompt: list[int]) -> list[int]:
    from kvmesh.kvcache import block_hashes

    return block_hashes(prompt[: (len(prompt) - 1) // BLOCK * BLOCK], BLOCK, engine.hash_seed)


def test_the_default_host_tier_fits_in_a_pods_memory_limit_not_its_nodes(tmp_path):
    """On a GPU the default is a share of the memory the process may still take: in a pod
    that is its cgroup's limit less its usage, not the node's MemAvailable."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 2097152000 kB\nMemAvailable: 1048576000 kB\n")  # a 1000 GiB node
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    limit.write_text(f"{64 * GiB}\n")
    usage.write_text(f"{16 * GiB}\n")
    assert available_memory(str(meminfo), [(str(limit), str(usage))]) == 48 * GiB
    limit.write_text("max\n")  # no limit of its own: the node's
    assert available_memory(str(meminfo), [(str(limit), str(usage))]) == 1000 * GiB
    assert available_memory(str(meminfo), [(str(tmp_path / "none"), str(usage))]) == 1000 * GiB
    assert available_memory(str(tmp_path / "none")) == 0
    assert host_kv_gib(None, "cpu", 0)[0] == 0 and host_kv_gib(2.5, "cuda", 8) == (2.5, "host_kv_gib=2.5")
