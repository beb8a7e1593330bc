"""The committed generated protobuf modules match the .proto sources."""

from pathlib import Path


from protos.build import PROTO_DIR, compile_protos


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    generated = compile_protos(out_dir=tmp_path)
    assert generated, "no .proto files found under protos/"
    for fresh in generated:
        committed = PROTO_DIR / fresh.name
        assert committed.exists(), f"{committed} is missing: run `make protos`"
        assert committed.read_text() == fresh.read_text(), f"{committed} is stale: run `make protos`"
