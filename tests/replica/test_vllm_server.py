"""What a replica says when its vLLM dies: the root cause, not a warning that quotes an error."""

from kvmesh.replica.vllm.server import VllmOptions, VllmServer

# The shape of a real failed start in the vLLM image before it carried libnuma.
FAILED_START = [
    "WARNING 12-06 10:40:01 [system_utils.py:120] Found ulimit of 1024 and failed to "
    "automatically increase with error current limit exceeds maximum limit. This can cause "
    "fd limit errors like `OSError: [Errno 24] Too many open files`.",
    "INFO 12-06 10:40:02 [importing.py:44] Failed to import from vllm._C_AVX2: "
    "ImportError('libnuma.so.1: cannot open shared object file')",
    "(EngineCore_DP0 pid=77) ERROR 12-06 10:40:09 [core.py:700] AttributeError: '_OpNamespace' "
    "'_C' object has no attribute 'init_cpu_memory_env'",
    "RuntimeError: Engine core initialization failed. See root cause above.",
]


def server_with_output(lines: list[str]) -> VllmServer:
    options = VllmOptions(
        model_dir="/nonexistent",
        served_name="m",
        block_size=32,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        kv_cache_memory=1 << 30,
        gpu_memory_utilization=0.9,
        seed=0,
        device="cpu",
    )
    server = VllmServer(options, token=None)
    server._tail.extend(lines)
    return server


def test_the_cause_is_the_first_error_not_a_warning_quoting_one():
    server = server_with_output(FAILED_START)
    try:
        assert server.cause().startswith("AttributeError: '_OpNamespace' '_C' object")
    finally:
        server.stop()


def test_without_an_error_line_the_cause_is_the_last_lines():
    server = server_with_output(FAILED_START[:2] + ["Killed"])
    try:
        cause = server.cause()
        assert cause.endswith("Killed") and cause.count(" | ") == 2
    finally:
        server.stop()
