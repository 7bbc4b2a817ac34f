"""Regenerate the Python stubs from the .proto files (``make protos``).

The .proto files live at ``protos/kvmesh/v1/``; they are compiled under the virtual
path ``kvmesh/protos/`` so the generated imports read ``kvmesh.protos.kvmesh.v1``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

HERE = Path(__file__).resolve().parent
PROTOS = sorted(HERE.glob("kvmesh/v1/*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Compile every .proto into ``out_root`` (mirroring ``protos/``); returns the files written."""
    include = str(Path(protoc.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-Ikvmesh/protos={HERE}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
        ]
        args += [f"kvmesh/protos/{p.relative_to(HERE)}" for p in PROTOS]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
        written = []
        for f in sorted((Path(tmp) / "kvmesh" / "protos").rglob("*.py*")):
            dest = out_root / f.relative_to(Path(tmp) / "kvmesh" / "protos")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, dest)
            written.append(dest)
        return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(f"wrote {path}")
