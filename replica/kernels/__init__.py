"""kvmesh.replica.kernels: the engine's own GPU kernels, in Triton.

Owns the paged-attention kernels (every step's shape: prefill continuing a cached prefix,
chunked prefill, decode split across programs) and the KV write by slot mapping, reading
the engine's block pool in place. Imports Triton, so nothing here is imported until a
backend that uses it is chosen; it must not import the engine, the scheduler or anything
above them. Off CUDA the kernels run in Triton's interpreter: this package sets
``TRITON_INTERPRET=1`` before any kernel is defined (Triton reads it then, not at launch), so
the tests prove the kernels on a CPU, and an engine told to use them there is slow but right.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
