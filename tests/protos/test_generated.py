"""The committed generated protobuf modules match the .proto sources.

What is compared is the generated API, not the generator's version: the serialized file
descriptor (every message, field, enum and service) and the rest of each module's syntax tree,
with the two version stamps taken out (``ValidateProtobufRuntimeVersion``'s numbers and
``GRPC_GENERATED_VERSION``). A locked grpcio-tools upgrade that writes only a new stamp leaves
the committed code fresh; a changed .proto does not.
"""

import ast
from pathlib import Path

import pytest

from protos.build import PROTO_DIR, api_of, compile_protos


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    generated = compile_protos(out_dir=tmp_path)
    assert generated, "no .proto files found under protos/"
    for fresh in generated:
        committed = PROTO_DIR / fresh.name
        assert committed.exists(), f"{committed} is missing: run `make protos`"
        assert api_of(committed.read_text()) == api_of(fresh.read_text()), f"{committed} is stale: run `make protos`"


def test_a_version_stamp_alone_is_not_staleness() -> None:
    for path in sorted(PROTO_DIR.glob("*_pb2*.py")):
        text = path.read_text()
        restamped = text.replace("GRPC_GENERATED_VERSION = '", "GRPC_GENERATED_VERSION = '9.").replace(
            "_runtime_version.Domain.PUBLIC,\n    ", "_runtime_version.Domain.PUBLIC,\n    9")
        assert restamped != text, path
        assert api_of(restamped) == api_of(text), path


@pytest.mark.parametrize("edit", ["field", "method"])
def test_a_changed_api_is_staleness(edit: str) -> None:
    if edit == "field":
        text = (PROTO_DIR / "ps_pb2.py").read_text()
        changed = text.replace("\\x12\\r\\n\\x05table\\x18\\x01", "\\x12\\r\\n\\x05tablf\\x18\\x01", 1)
    else:
        text = (PROTO_DIR / "ps_pb2_grpc.py").read_text()
        changed = text.replace("'/metaps.ps.ParameterServer/Pull'", "'/metaps.ps.ParameterServer/Pul1'", 1)
    assert changed != text
    assert api_of(changed) != api_of(text)
    ast.parse(changed)
