"""Compile ``protos/*.proto`` into Python modules next to them.

The generated ``*_pb2.py`` / ``*_pb2_grpc.py`` files are committed so a fresh
clone works without grpcio-tools; ``tests/protos/test_generated.py`` fails when
they are stale: their API (:func:`api_of`) differs from a fresh compile's. The
generator's version stamps are not part of the API, so a locked grpcio-tools
upgrade alone does not make them stale. Regenerate with ``make protos`` (or ``python -m protos.build``).
"""

from __future__ import annotations

import argparse
import ast
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


def api_of(source: str) -> str:
    """The generated API of a ``*_pb2.py`` / ``*_pb2_grpc.py`` module's source, as a comparable string.

    The module's syntax tree (comments and layout dropped) with the generator's version stamps
    blanked: the numbers passed to ``ValidateProtobufRuntimeVersion`` and the value of
    ``GRPC_GENERATED_VERSION``. Everything else stays, the serialized descriptor included.

    Args:
        source: the module's text.
    """
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "ValidateProtobufRuntimeVersion"):
            node.args = [a for a in node.args if not (isinstance(a, ast.Constant) and isinstance(a.value, int))]
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
              and node.targets[0].id == "GRPC_GENERATED_VERSION"):
            node.value = ast.Constant(value="")
    return ast.dump(tree)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    for path in compile_protos():
        log.info("generated %s", path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
