"""Model tests use tiny tensors: one intra-op thread avoids thread-sync overhead on a shared box."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def assert_evaluate_matches_training(ckpt: Path, data: Path, out: Path, model: Any, rows: Any, learner: Any,
                                     metrics: tuple[str, ...] = ("auc", "logloss")) -> None:
    """``metaps evaluate --checkpoint ckpt --protocol episodes`` equals the training-time evaluation
    (``workers.evaluation.evaluate`` on the same model, rows and learner), adapted heads, to 1e-6."""
    import json

    from meta_io.reader import MetaIODataset
    from metaps.cli import main
    from workers.evaluation import evaluate

    assert main(["evaluate", "--checkpoint", str(ckpt), "--data", str(data), "--protocol", "episodes",
                 "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    want = evaluate(model, rows, MetaIODataset(data).iter_all(), learner)
    assert want["adapted"]
    for h in want["adapted"]:
        for m in metrics:
            assert rep["adapted"][h][m] == pytest.approx(want["adapted"][h][m], abs=1e-6), (h, m)
