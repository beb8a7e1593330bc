"""Compile ``protos/*.proto`` into Python modules next to them.

The generated ``*_pb2.py`` / ``*_pb2_grpc.py`` files are committed so a fresh
clone works without grpcio-tools; ``tests/protos/test_generated.py`` fails when
they are stale. Regenerate with ``make protos`` (or ``python -m protos.build``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def compile_protos(out_dir: Path = ROOT) -> list[Path]:
    """Compile every ``protos/*.proto``; output goes to ``out_dir/protos/``.

    Imports in the generated code are package-qualified (``from protos import
    x_pb2``) because protoc runs from the repository root.
    """
    from grpc_tools import protoc  # test extra; not needed at run time
    import grpc_tools

    protos = sorted(PROTO_DIR.glob("*.proto"))
    if not protos:
        return []
    (out_dir / "protos").mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(ROOT)) for p in protos],
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc} for {[p.name for p in protos]}")
    return sorted((out_dir / "protos").glob("*_pb2*.py"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    for path in compile_protos():
        log.info("generated %s", path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
