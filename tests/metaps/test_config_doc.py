"""docs/configuration.md is exactly what the config dataclasses render."""

from metaps.config_doc import DOC_PATH, render


def test_configuration_reference_in_sync() -> None:
    assert DOC_PATH.exists(), "docs/configuration.md is missing: run `python -m metaps.config_doc`"
    assert DOC_PATH.read_text() == render(), "docs/configuration.md is stale: run `python -m metaps.config_doc`"


def test_every_section_key_is_documented() -> None:
    text = render()
    for section in ("[data]", "[ps]", "[model]", "[meta]", "[train]", "[controller]", "[faults]", "[rpc]",
                    "[delivery]", "[run]", "[ps.table_defaults.optimizer]"):
        assert f"`{section}`" in text, section
