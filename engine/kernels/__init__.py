"""kvmesh.engine.kernels: the engine's own GPU kernels, in Triton.

Owns the paged-attention kernels (every step's shape: prefill continuing a cached prefix,
chunked prefill, decode split across programs) and the KV write by slot mapping, reading
the engine's block pool in place. Imports Triton, so nothing here is imported until a
backend that uses it is chosen; it must not import the engine, the scheduler or anything
above them. Off CUDA the kernels run in Triton's interpreter: this package sets
``TRITON_INTERPRET=1`` before any kernel is defined (Triton reads it then, not at launch), so
the tests prove the kernels on a CPU, and an engine told to use them there is slow but right.
Where Triton was imported before that (torch's dynamo imports it when a model loads), its
standard library (``tl.max``, ``tl.zeros``) is compiled code the interpreter cannot call: this
says so at once, and the cure is ``TRITON_INTERPRET=1`` in the environment from the start
(the tests' conftest sets it).
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and not os.environ.get("TRITON_INTERPRET"):
        raise ImportError(
            "kvmesh's Triton kernels off CUDA run in Triton's interpreter, which must be on before Triton "
            "is first imported: start the process with TRITON_INTERPRET=1"
        )
    os.environ.setdefault("TRITON_INTERPRET", "1")
