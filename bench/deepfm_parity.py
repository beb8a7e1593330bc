"""metaps's ``deepfm`` against a plain-torch DeepFM on the same rows and features.

Run (a mode of ``bench.quality``; this module is its helper)::

    python -m bench.quality deepfm-parity [--rows 32000] [--seeds 3,4,5] [--epochs 2] [--set S.K=V]
    python -m bench.quality deepfm-parity --smoke      # 3k rows, 1 seed, 1 epoch: every step once

Issue 29 found metaps's ``deepfm`` 0.012 AUC below a plain DeepFM on the same features.
Per seed this bench generates AntM2C-like rows (``bench.quality_setup.cold_generator_config``),
holds out 25% of the users (``bench.quality_setup.cold_split``), builds the training users' rows
as a plain Meta-IO layout (256 rows a batch) and trains, on exactly those batches:

* **metaps** ``deepfm`` and ``dnn`` (``train-local`` of ``bench.quality_setup.job_for``'s plain job:
  dim-8 rows with rowwise Adagrad 0.1 on the PS side, Adam 0.005 dense, hidden [64, 32]), scored
  by :func:`metaps.evaluate.evaluate_report` (``--protocol plain``) on every held-out row;
* **plain DeepFM** (:class:`PlainDeepFM`, one model per head, as a team would write it):
  one embedding per id column over the training rows' vocabulary (an unseen id gets its
  column's "unknown" row), list columns pooled with the schema's pooling, FM
  ``sum_{i<j} <v_i, v_j>`` over the id fields, a first-order weight per id plus a linear
  term over the dense (``sign(x) log1p|x|``, metaps's transform) and vector columns, and an
  MLP (same hidden sizes) over every field embedding, the dense and the vector columns;
  N(0, 0.01) embeddings, Adam 1e-3 on everything, batches of 256 in the Meta-IO batch order,
  shuffled per epoch (seeded); scored on the same held-out rows (the same targets:
  conversion = CTCVR, :func:`workers.evaluation.head_target`);
* **plain DeepFM with metaps's optimizers**: the same, its embeddings and first-order weights
  trained by Adagrad at the metaps job's table lr (torch's elementwise Adagrad; the PS runs
  rowwise Adagrad) and the rest by Adam at the job's dense lr: the control that separates the
  model from the optimizer settings.

Per seed and head: the AUCs, ``deepfm_minus_plain`` (metaps deepfm - plain DeepFM) and
``deepfm_minus_plain_same_optimizers``; ``--set`` overrides apply to the metaps arms and the
control's learning rates. The last line printed is a JSON object. Feature encoding is array ops over columns (``np.searchsorted``
vocabularies), the training loop runs over batches, never rows.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor, nn

HEADS = ("click", "conversion")
SMOKE_ROWS = 3_000
EMB_DIM = 8
HIDDEN = (64, 32)


def _progress(msg: str) -> None:
    print(msg, flush=True)


class Encoded:
    """Rows encoded for :class:`PlainDeepFM`: per id column slots and pooling weights, dense, targets.

    Args:
        slots: per id column ``[N, W_c]`` int64 global embedding rows (the column's unknown row
            for an id outside the training vocabulary).
        weights: per id column ``[N, W_c]`` float32 pooling weights (0 on padding).
        dense: ``[N, n_dense + vector dims]`` float32: ``sign(x) log1p|x|`` dense, raw vectors.
        y: ``[N, H]`` float32 targets.
    """

    def __init__(self, slots: list[Tensor], weights: list[Tensor], dense: Tensor, y: Tensor) -> None:
        self.slots, self.weights, self.dense, self.y = slots, weights, dense, y

    @property
    def rows(self) -> int:
        return int(self.y.shape[0])

    def take(self, idx: Tensor) -> "Encoded":
        return Encoded([s[idx] for s in self.slots], [w[idx] for w in self.weights], self.dense[idx], self.y[idx])


class Vocab:
    """Per id column the sorted ids of the training rows; global rows ``base + 1 + pos`` (``base``: unknown).

    Args:
        schema: the data's schema.
        batches: the training rows' feature batches.
    """

    def __init__(self, schema: Any, batches: Sequence[Any]) -> None:
        self.schema = schema
        self.cols = list(schema.id_columns)
        self.vocab: dict[str, np.ndarray] = {}
        self.base: dict[str, int] = {}
        pos = 0
        for c in self.cols:
            ids = np.concatenate([fb.ids[c.name].reshape(_n(fb), -1).numpy()[_real(fb)].reshape(-1) for fb in batches])
            self.vocab[c.name] = np.unique(ids[ids >= 0])
            self.base[c.name] = pos
            pos += 1 + self.vocab[c.name].shape[0]
        self.size = pos

    def encode(self, batches: Sequence[Any]) -> Encoded:
        """The real rows of ``batches``, in order."""
        from meta_io.schema import ColumnKind, Pooling
        from models.layers import signed_log1p
        from workers.evaluation import head_target

        slots: list[list[np.ndarray]] = [[] for _ in self.cols]
        weights: list[list[np.ndarray]] = [[] for _ in self.cols]
        dense, ys = [], []
        for fb in batches:
            n, real = _n(fb), _real(fb)
            for j, c in enumerate(self.cols):
                ids = fb.ids[c.name].reshape(n, -1).numpy()[real]
                valid = ids >= 0
                voc = self.vocab[c.name]
                pos = np.searchsorted(voc, ids).clip(max=max(voc.shape[0] - 1, 0))
                found = valid & (voc[pos] == ids) if voc.shape[0] else np.zeros_like(valid)
                slots[j].append(np.where(found, self.base[c.name] + 1 + pos, self.base[c.name]))
                cnt = valid.sum(1, keepdims=True).clip(min=1)
                w = 1.0 if (c.kind == ColumnKind.SPARSE or c.pooling == Pooling.SUM) else 1.0 / cnt
                weights[j].append(np.where(valid, w, 0.0).astype(np.float32))
            blocks = [signed_log1p(fb.dense).reshape(n, -1)] + [fb.vectors[c.name].reshape(n, -1)
                                                                 for c in self.schema.vector_columns]
            dense.append(torch.cat(blocks, dim=1)[torch.from_numpy(real)].float())
            ys.append(torch.stack([head_target(h, fb.labels).reshape(-1) for h in HEADS], 1)[torch.from_numpy(real)])
        return Encoded([torch.from_numpy(np.concatenate(s)).long() for s in slots],
                       [torch.from_numpy(np.concatenate(w)) for w in weights],
                       torch.cat(dense), torch.cat(ys).float())


def _n(fb: Any) -> int:
    return int(np.prod(fb.mask.shape))


def _real(fb: Any) -> np.ndarray:
    return fb.mask.reshape(-1).numpy().astype(bool)


class PlainDeepFM(nn.Module):
    """Textbook DeepFM, one logit: first order + FM over the id fields + MLP (module docstring).

    Args:
        rows: embedding rows (:attr:`Vocab.size`).
        fields: id columns.
        n_dense: dense + vector inputs.
        dim: embedding width.
        hidden: MLP sizes.
    """

    def __init__(self, rows: int, fields: int, n_dense: int, dim: int = EMB_DIM,
                 hidden: Sequence[int] = HIDDEN) -> None:
        super().__init__()
        self.emb = nn.Embedding(rows, dim)
        self.w1 = nn.Embedding(rows, 1)
        nn.init.normal_(self.emb.weight, std=0.01)
        nn.init.zeros_(self.w1.weight)
        self.linear = nn.Linear(n_dense, 1)
        layers: list[nn.Module] = []
        width = fields * dim + n_dense
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x: Encoded) -> Tensor:
        v = torch.stack([(self.emb(s) * w.unsqueeze(-1)).sum(1) for s, w in zip(x.slots, x.weights)], dim=1)
        first = sum((self.w1(s).squeeze(-1) * w).sum(1) for s, w in zip(x.slots, x.weights)) + self.linear(x.dense)[:, 0]
        fm = 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(-1)
        deep = self.mlp(torch.cat([v.flatten(1), x.dense], dim=1))[:, 0]
        return first + fm + deep


def train_plain(train: Encoded, vocab: Vocab, epochs: int, seed: int, head: int, batch: int = 256,
                lr: float = 1e-3, emb_adagrad_lr: float = 0.0) -> PlainDeepFM:
    """One :class:`PlainDeepFM` for head ``head``, ``epochs`` passes in seeded shuffled batches.

    Args:
        lr: Adam's learning rate (every parameter; the dense ones only with ``emb_adagrad_lr``).
        emb_adagrad_lr: > 0: the embeddings and first-order weights train with Adagrad at this rate
            (metaps's PS side: rowwise Adagrad; torch's is elementwise), the rest with Adam ``lr``.
    """
    torch.manual_seed(seed)
    model = PlainDeepFM(vocab.size, len(vocab.cols), int(train.dense.shape[1]))
    sparse = [model.emb.weight, model.w1.weight]
    if emb_adagrad_lr > 0:
        dense = [p for n, p in model.named_parameters() if not n.startswith(("emb.", "w1."))]
        opts: list[torch.optim.Optimizer] = [torch.optim.Adagrad(sparse, lr=emb_adagrad_lr),
                                             torch.optim.Adam(dense, lr=lr)]
    else:
        opts = [torch.optim.Adam(model.parameters(), lr=lr)]
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(train.rows, generator=g)
        for i in range(0, train.rows, batch):
            part = train.take(perm[i:i + batch])
            loss = nn.functional.binary_cross_entropy_with_logits(model(part), part.y[:, head])
            for o in opts:
                o.zero_grad()
            loss.backward()
            for o in opts:
                o.step()
    return model


@torch.no_grad()
def plain_aucs(train: Encoded, test: Encoded, vocab: Vocab, epochs: int, seed: int, lr: float = 1e-3,
               emb_adagrad_lr: float = 0.0) -> dict[str, float]:
    """AUC per head of a plain DeepFM trained per head on ``train`` (:func:`train_plain`), scored on ``test``."""
    from common.evaluation import auc

    out = {}
    for j, h in enumerate(HEADS):
        with torch.enable_grad():
            m = train_plain(train, vocab, epochs, seed, j, lr=lr, emb_adagrad_lr=emb_adagrad_lr)
        m.eval()
        out[h] = float(auc(test.y[:, j].double().numpy(), m(test).double().numpy()))
    return out


def job_mapping(train_dir: Path, run_dir: Path, kind: str, epochs: int, seed: int,
                sets: Sequence[str] = ()) -> dict[str, Any]:
    """``bench.quality_setup.job_for``'s plain job with model ``kind``, ``[train] seed``, no eval set, ``sets`` applied.

    Args:
        sets: ``SECTION.KEY=VALUE`` overrides (a dotted path into the job; a value that parses as
            JSON is taken as JSON, else as a string), e.g. ``ps.table_defaults.optimizer.lr=0.02``.

    Raises:
        ConfigError: an override without ``=`` (one line).
    """
    from bench.quality_setup import job_for
    from common.errors import ConfigError

    data: dict[str, Any] = job_for(train_dir, train_dir, run_dir, "plain", kind, epochs).to_dict()
    data["data"]["eval"] = ""
    data["train"]["seed"] = seed
    for s in sets:
        key, eq, value = s.partition("=")
        if not eq or not key:
            raise ConfigError(f"--set: expected SECTION.KEY=VALUE, got {s!r}")
        *path, leaf = key.split(".")
        node = data
        for p in path:
            node = node.setdefault(p, {})
        try:
            node[leaf] = json.loads(value)
        except json.JSONDecodeError:
            node[leaf] = value
    return data


def metaps_aucs(train_dir: Path, holdout_raw: Path, run_dir: Path, kind: str, epochs: int, seed: int,
                sets: Sequence[str] = ()) -> dict[str, float]:
    """train-local of :func:`job_mapping`'s job; AUC per head on the held-out rows (``metaps evaluate --protocol plain``)."""
    from metaps.evaluate import evaluate_report
    from metaps.job import job_from_mapping
    from workers.local import train_local

    data = job_mapping(train_dir, run_dir, kind, epochs, seed, sets)
    train_local(job_from_mapping(data, where="<bench.deepfm_parity>"), run_dir, checkpoint=True)
    rep = evaluate_report(holdout_raw, "plain", checkpoint=run_dir)
    return {h: float(rep["base"][h]["auc"]) for h in HEADS}


def one_seed(seed: int, rows: int, epochs: int, sets: Sequence[str]) -> dict[str, Any]:
    """Data, the metaps arms and the plain DeepFM of one seed (scratch folder, removed after)."""
    from bench.quality_setup import cold_generator_config, cold_sizes, cold_split
    from meta_io.batch import PlainBatch
    from meta_io.build import MetaIOBuildConfig, build
    from meta_io.layout import Layout
    from meta_io.reader import MetaIODataset
    from meta_io.schema import load_schema

    rows, users, items, fraction = cold_sizes(True, rows)
    with tempfile.TemporaryDirectory(prefix="bench-deepfm-") as td:
        tmp = Path(td)
        from meta_io.synth import generate

        gen = generate(tmp / "raw", cold_generator_config(rows, users, items, seed), progress=False)
        split = cold_split(gen, tmp, seed, fraction)
        cfg = MetaIOBuildConfig(layout=Layout.PLAIN, rows_per_batch=256)
        train_dir = build(split.train_dir, split.schema_path, tmp / "p-train", cfg).out_dir
        hold_dir = build(split.holdout_dir, split.schema_path, tmp / "p-hold", cfg).out_dir
        out: dict[str, Any] = {}
        t0 = time.perf_counter()
        for kind in ("deepfm", "dnn"):
            _progress(f"[seed {seed}] metaps {kind}")
            out[f"metaps_{kind}"] = metaps_aucs(train_dir, split.holdout_dir, tmp / f"run-{kind}", kind, epochs,
                                                seed, sets)
        _progress(f"[seed {seed}] plain DeepFM")
        schema = load_schema(split.schema_path)
        tr = [b.features for b in MetaIODataset(train_dir).iter_all() if isinstance(b, PlainBatch)]
        te = [b.features for b in MetaIODataset(hold_dir).iter_all() if isinstance(b, PlainBatch)]
        vocab = Vocab(schema, tr)
        etr, ete = vocab.encode(tr), vocab.encode(te)
        out["plain_deepfm"] = plain_aucs(etr, ete, vocab, epochs, seed)
        ps = job_mapping(train_dir, tmp, "deepfm", epochs, seed, sets)["ps"]
        out["plain_deepfm_metaps_optimizers"] = plain_aucs(
            etr, ete, vocab, epochs, seed, lr=float(ps["dense_optimizer"]["lr"]),
            emb_adagrad_lr=float(ps["table_defaults"]["optimizer"]["lr"]))
        out["deepfm_minus_plain"] = {h: out["metaps_deepfm"][h] - out["plain_deepfm"][h] for h in HEADS}
        out["deepfm_minus_plain_same_optimizers"] = {
            h: out["metaps_deepfm"][h] - out["plain_deepfm_metaps_optimizers"][h] for h in HEADS}
        out["elapsed_s"] = time.perf_counter() - t0
        _progress(f"[seed {seed}] " + "; ".join(
            f"{h}: metaps deepfm {out['metaps_deepfm'][h]:.4f} dnn {out['metaps_dnn'][h]:.4f} | plain DeepFM "
            f"{out['plain_deepfm'][h]:.4f} ({out['deepfm_minus_plain'][h]:+.4f}), with metaps's optimizers "
            f"{out['plain_deepfm_metaps_optimizers'][h]:.4f} ({out['deepfm_minus_plain_same_optimizers'][h]:+.4f})"
            for h in HEADS))
    return out


def run(argv: Sequence[str]) -> int:
    """``python -m bench.quality deepfm-parity ARGS``: parse ``argv``, run every seed, print the JSON line.

    Args:
        argv: the arguments after ``deepfm-parity``.
    """
    ap = argparse.ArgumentParser(prog="python -m bench.quality deepfm-parity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32_000, help="generated rows (default 32k; 25%% of users held out)")
    ap.add_argument("--seeds", default="3,4,5", help="comma-separated seeds")
    ap.add_argument("--epochs", type=int, default=2, help="epochs of every arm")
    ap.add_argument("--smoke", action="store_true", help=f"{SMOKE_ROWS} rows, seed 3, 1 epoch (figures meaningless)")
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="SECTION.KEY=VALUE",
                    help="an override of the metaps arms' job, e.g. model.default_dim=16; repeatable")
    args = ap.parse_args(list(argv))
    torch.set_num_threads(1)
    seeds = [3] if args.smoke else [int(s) for s in args.seeds.split(",") if s.strip()]
    rows, epochs = (SMOKE_ROWS, 1) if args.smoke else (args.rows, args.epochs)
    per_seed = {s: one_seed(s, rows, epochs, args.sets) for s in seeds}
    summary = {}
    for key in ("deepfm_minus_plain", "deepfm_minus_plain_same_optimizers"):
        summary[f"{key}_mean"] = {h: float(np.mean([r[key][h] for r in per_seed.values()])) for h in HEADS}
        _progress(f"mean {key}: " + ", ".join(f"{h} {v:+.4f}" for h, v in summary[f"{key}_mean"].items()))
    print(json.dumps({"rows": rows, "epochs": epochs, "seeds": seeds, "sets": args.sets, "per_seed": per_seed,
                      **summary}, default=float), flush=True)
    return 0
