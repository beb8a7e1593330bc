"""docs/configuration.md gives a nested table's defaults from the field that holds it (issue 29 item 5).

``[ps] dense_optimizer`` defaults to ``OptimizerConfig(kind="adam", lr=1e-3)``; the reference
used to list ``OptimizerConfig``'s own field defaults (an embedding table's rowwise_adagrad,
0.05). Every table below is checked against the value the code really starts from.
"""

from __future__ import annotations

import dataclasses
import re

from metaps.config_doc import DOC_PATH, _default_str, render
from metaps.deploy.config import DeployConfig
from ps.config import PsConfig
from workers.config import TrainConfig


def _table(text: str, key: str) -> dict[str, str]:
    """key -> default cell of the ``[key]`` table of the rendered reference."""
    m = re.search(rf"^### `\[{re.escape(key)}\]`.*?\n\n(?:.*?\n\n)?(\| key .*?)(?:\n\n|\Z)", text, flags=re.S | re.M)
    assert m, f"no [{key}] table"
    rows = [r.split(" | ") for r in m.group(1).splitlines()[2:]]
    return {r[0].strip("| `"): r[2] for r in rows}


def _check(text: str, key: str, instance: object) -> None:
    got = _table(text, key)
    for f in dataclasses.fields(instance):  # type: ignore[arg-type]
        want = _default_str(getattr(instance, f.name)).replace("|", "\\|")
        assert got[f.name] == want, f"[{key}] {f.name}: documented {got[f.name]}, the code's default is {want}"


def test_nested_tables_document_the_holding_fields_default() -> None:
    text = render()
    ps = PsConfig()
    assert _table(text, "ps.dense_optimizer")["kind"] == '"adam"' and _table(text, "ps.dense_optimizer")["lr"] == "0.001"
    _check(text, "ps.dense_optimizer", ps.dense_optimizer)
    _check(text, "ps.table_defaults.optimizer", ps.table_defaults.optimizer)
    res = DeployConfig().resources
    for role in ("controller", "ps", "worker", "data", "deliver"):
        _check(text, f"deploy.resources.{role}", getattr(res, role))
    assert _table(text, "train")["early_stop_metric"] == '"auc"'
    _check(text, "train", TrainConfig())


def test_the_committed_reference_is_the_rendered_one() -> None:
    assert DOC_PATH.read_text() == render(), "docs/configuration.md is stale: python -m metaps.config_doc"
