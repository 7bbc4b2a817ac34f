"""Compile kvmesh's Triton kernels for a GPU architecture with Triton's own compiler (down to
the GPU's machine code, by ptxas), on a machine with no GPU. The interpreter that runs the
kernels in the CPU tests checks none of what only the compiler does (tile shapes ``tl.dot``
accepts, types, what a loop may carry): this does. Run with ``TRITON_INTERPRET=0``.

    python tests/support/triton_compile.py [ARCH]   # 90: H100/H200 (the default)

Prints one line a variant and exits 1 if any failed to compile.
"""

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvmesh.engine.kernels import paged_attention as pa

POINTER = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
I32 = "i32"


def attention(dtype: str, head_dim: int, group: int, block_size: int, decode: bool, segments: int):
    block_q, group_p, dim_p = pa.program_shape(group, head_dim, decode)
    data, parts = POINTER[dtype], "*fp32" if segments > 1 else POINTER[dtype]
    pointers = ["out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr"]
    ints = ["num_seqs", "num_heads", "table_stride", "stride_qt", "stride_qh", "stride_ot", "stride_oh"]
    signature = {
        **dict.fromkeys(pointers, data),
        **dict.fromkeys(["block_tables_ptr", "query_start_ptr", "context_lens_ptr"], "*i32"),
        **dict.fromkeys(["part_max_ptr", "part_sum_ptr", "part_acc_ptr"], parts),
        "scale": "fp32",
        **dict.fromkeys([*ints, "stride_cb", "stride_cs", "stride_ch"], I32),
    }
    constants = {
        "BLOCK_SIZE": block_size,
        "GROUP": group,
        "GROUP_P": group_p,
        "BLOCK_Q": block_q,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_P": dim_p,
        "TILE_KEYS": pa.TILE,
        "SEGMENTS": segments,
        "PRECISION": "ieee" if dtype == "fp32" else "tf32",
    }
    return pa._attention_kernel, signature, constants


def merge(dtype: str, head_dim: int, segments: int):
    signature = {
        "out_ptr": POINTER[dtype],
        **dict.fromkeys(["part_max_ptr", "part_sum_ptr", "part_acc_ptr"], "*fp32"),
        **dict.fromkeys(["num_heads", "stride_ot", "stride_oh"], I32),
    }
    _, _, dim_p = pa.program_shape(1, head_dim, True)
    constants = {"HEAD_DIM": head_dim, "HEAD_DIM_P": dim_p, "SEGMENTS": segments}
    return pa._merge_segments_kernel, signature, constants


def store(dtype: str, width: int):
    signature = {
        **dict.fromkeys(["k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr"], POINTER[dtype]),
        "slots_ptr": "*i64",
        **dict.fromkeys(["stride_kt", "stride_vt"], I32),
    }
    return pa._store_kv_kernel, signature, {"WIDTH": width, "WIDTH_P": triton.next_power_of_2(width)}


# What the engine launches: serving dtypes at Qwen3-like head sizes and GQA ratios, the CUDA
# tests' fp32 tiny model (head size 32), decode split or not, prefill, blocks of 16 to 256.
VARIANTS = [
    *(attention("bf16", 128, 2, 16, True, s) for s in (1, 16)),
    attention("bf16", 128, 2, 16, False, 1),
    attention("bf16", 64, 8, 256, True, 4),
    attention("bf16", 64, 8, 256, False, 1),
    attention("bf16", 128, 1, 32, True, 1),
    attention("fp16", 128, 4, 16, True, 2),
    attention("fp16", 128, 4, 16, False, 1),
    attention("fp32", 32, 2, 256, True, 1),
    attention("fp32", 32, 2, 16, False, 1),
    merge("bf16", 128, 16),
    merge("fp32", 32, 4),
    store("bf16", 1024),
    store("fp32", 64),
]


def main(arch: int) -> int:
    target = GPUTarget("cuda", arch, 32)
    failed = 0
    for kernel, signature, constants in VARIANTS:
        signature = {**signature, **dict.fromkeys(constants, "constexpr")}
        name = f"{kernel.fn.__name__} {constants}"
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constants), target=target)
            print(f"ok {name}: {compiled.metadata.shared} bytes of shared memory")
        except Exception as exc:  # the compiler's message is the result
            failed += 1
            print(f"FAILED {name}: {type(exc).__name__}: {str(exc)[:1500]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 90))
