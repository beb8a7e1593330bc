"""bench.deepfm_parity's plain reference: its FM against the pairwise definition, its features
(vocabularies, the unknown row, pooled lists), the same-optimizer control, and the job overrides."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from bench.deepfm_parity import Encoded, PlainDeepFM, Vocab, job_mapping, train_plain
from meta_io.batch import FeatureBatch
from meta_io.schema import schema_from_dict
from common.errors import ConfigError

SCHEMA = schema_from_dict({
    "task_key": "user_id", "labels": ["click", "conversion"],
    "columns": [{"name": "user_id", "kind": "sparse"}, {"name": "tags", "kind": "multi_hot", "max_len": 3},
                {"name": "price", "kind": "dense"}, {"name": "click", "kind": "label"},
                {"name": "conversion", "kind": "label"}]})


def _fb(users: list[int], tags: list[list[int]], price: list[float], click: list[float],
        mask: list[bool] | None = None) -> FeatureBatch:
    n = len(users)
    return FeatureBatch(ids={"user_id": torch.tensor(users)[:, None],
                             "tags": torch.tensor([t + [-1] * (3 - len(t)) for t in tags])},
                        dense=torch.tensor(price)[:, None], vectors={},
                        labels={"click": torch.tensor(click), "conversion": torch.tensor(click)},
                        mask=torch.tensor(mask) if mask is not None else torch.ones(n, dtype=torch.bool),
                        scenario=torch.zeros(n, dtype=torch.int64))


def test_fm_is_the_sum_over_field_pairs_of_their_dot_products() -> None:
    torch.manual_seed(0)
    fields, dim, n = 4, 3, 5
    m = PlainDeepFM(rows=20, fields=fields, n_dense=2, dim=dim, hidden=(4,))
    last = m.mlp[-1]
    assert isinstance(last, torch.nn.Linear)
    with torch.no_grad():  # everything but the FM term at 0: first order, dense linear, the MLP's output
        m.w1.weight.zero_()
        m.linear.weight.zero_()
        m.linear.bias.zero_()
        last.weight.zero_()
        last.bias.zero_()
        m.emb.weight.normal_()
    slots = [torch.randint(0, 20, (n, 2)) for _ in range(fields)]
    weights = [torch.rand(n, 2) for _ in range(fields)]
    x = Encoded(slots, weights, torch.randn(n, 2), torch.zeros(n, 2))
    v = [(m.emb.weight[s] * w.unsqueeze(-1)).sum(1) for s, w in zip(slots, weights)]  # pooled fields [n, D]
    want = sum((v[i] * v[j]).sum(-1) for i, j in itertools.combinations(range(fields), 2))
    with torch.no_grad():
        torch.testing.assert_close(m(x), want)


def test_vocab_unknown_row_pooled_lists_and_padding_rows() -> None:
    train = _fb([5, 7, 7, 9], [[1], [1, 2], [3, 1, 2], []], [0.0, 1.0, 2.0, 3.0], [0, 1, 0, 1])
    voc = Vocab(SCHEMA, [train])
    # user_id: row 0 = unknown, 1..3 = ids 5, 7, 9; tags: row 4 = unknown, 5..7 = tags 1, 2, 3
    assert voc.size == 8
    e = voc.encode([_fb([7, 42, 5], [[2, 3], [1, 99], [1]], [1.5, 9.0, 0.0], [0, 1, 1], mask=[True, True, False])])
    assert e.rows == 2  # the padding row is dropped
    assert e.slots[0][:, 0].tolist() == [2, 0]  # a seen user; an unseen one -> the column's unknown row
    assert e.slots[1][0].tolist()[:2] == [6, 7] and e.weights[1][0].tolist() == [0.5, 0.5, 0.0]  # mean of 2 tags
    assert e.slots[1][1].tolist()[:2] == [5, 4]  # tag 1, then tag 99 unseen -> unknown row
    assert e.dense[:, 0].tolist() == pytest.approx([float(torch.log1p(torch.tensor(1.5))), float(torch.log1p(torch.tensor(9.0)))])
    assert e.y.tolist() == [[0.0, 0.0], [1.0, 1.0]]


def test_the_same_optimizer_control_trains_embeddings_with_adagrad() -> None:
    """The first step moves every touched embedding entry by exactly the lr (Adagrad's and Adam's
    first step: lr * sign(g)); over 3 epochs the control equals a hand-run Adagrad (rows) + Adam
    (the rest) on the same batches, and differs from Adam everywhere."""
    voc = Vocab(SCHEMA, [_fb([5, 7], [[1], [2]], [0.0, 1.0], [0, 1])])
    x = voc.encode([_fb([5, 7], [[1], [2]], [0.0, 1.0], [0, 1])])
    for kwargs, step in (({"emb_adagrad_lr": 0.25}, 0.25), ({}, 1e-3)):
        torch.manual_seed(3)
        before = PlainDeepFM(voc.size, 2, 1).emb.weight.detach().clone()
        after = train_plain(x, voc, epochs=1, seed=3, head=0, batch=2, **kwargs).emb.weight.detach()
        moved = (after - before).abs()
        touched = moved[[1, 2, 4, 5]]  # users 5, 7 (rows 1, 2); tags 1, 2 (rows 4, 5; row 3: unknown tag)
        assert (touched > 0).float().mean() > 0.9, kwargs
        assert torch.allclose(touched[touched > 0], torch.tensor(step), rtol=1e-3), kwargs
        assert moved[[0, 3]].max() == 0  # the unknown rows were not used

    torch.manual_seed(3)
    ref = PlainDeepFM(voc.size, 2, 1)
    opts = [torch.optim.Adagrad([ref.emb.weight, ref.w1.weight], lr=0.25),
            torch.optim.Adam([p for n, p in ref.named_parameters() if not n.startswith(("emb.", "w1."))], lr=1e-3)]
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        perm = torch.randperm(x.rows, generator=g)
        for i in range(x.rows):
            part = x.take(perm[i:i + 1])
            loss = torch.nn.functional.binary_cross_entropy_with_logits(ref(part), part.y[:, 0])
            for o in opts:
                o.zero_grad()
            loss.backward()
            for o in opts:
                o.step()
    got = train_plain(x, voc, epochs=3, seed=3, head=0, batch=1, emb_adagrad_lr=0.25)
    adam = train_plain(x, voc, epochs=3, seed=3, head=0, batch=1, lr=0.25)
    torch.testing.assert_close(got.emb.weight, ref.emb.weight)
    rows = [1, 2, 4, 5]
    assert not torch.allclose(adam.emb.weight[rows], ref.emb.weight[rows], atol=1e-4)


def test_job_mapping_applies_overrides_as_json_or_text(tmp_path: Path) -> None:
    data = job_mapping(tmp_path / "train", tmp_path / "run", "deepfm", 2, 7,
                       ["ps.table_defaults.optimizer.lr=0.02", "model.hidden=[8, 4]", "run.name=x1"])
    assert data["ps"]["table_defaults"]["optimizer"]["lr"] == 0.02
    assert data["model"]["hidden"] == [8, 4] and data["model"]["kind"] == "deepfm"
    assert data["run"]["name"] == "x1" and data["train"]["seed"] == 7 and data["data"]["eval"] == ""
    with pytest.raises(ConfigError, match="expected SECTION.KEY=VALUE, got 'model.hidden'"):
        job_mapping(tmp_path / "train", tmp_path / "run", "deepfm", 2, 7, ["model.hidden"])


def test_the_mode_runs_every_arm_on_real_generated_data(capsys: pytest.CaptureFixture[str]) -> None:
    """``bench.quality deepfm-parity --smoke``: 3k generated rows, train-local deepfm and dnn, both plain
    DeepFMs, every figure finite in the JSON line (the figures themselves mean nothing at this size)."""
    import json
    import math

    from bench.quality import main

    assert main(["deepfm-parity", "--smoke"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    seed = res["per_seed"]["3"]
    for arm in ("metaps_deepfm", "metaps_dnn", "plain_deepfm", "plain_deepfm_metaps_optimizers",
                "deepfm_minus_plain", "deepfm_minus_plain_same_optimizers"):
        assert set(seed[arm]) == {"click", "conversion"} and all(math.isfinite(v) for v in seed[arm].values()), arm
    assert seed["deepfm_minus_plain"]["click"] == pytest.approx(
        seed["metaps_deepfm"]["click"] - seed["plain_deepfm"]["click"])
