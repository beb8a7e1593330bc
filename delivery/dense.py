"""The dense network of a bundle as TorchScript, and its flat input convention.

The whole model forward (lookup index, pooling, towers, heads) is traced with
``torch.jit.trace`` around a wrapper taking flat tensors; only the row gather
from LMDB happens outside, in :mod:`delivery.loader`. Inputs, in this order
(names recorded in the manifest under ``dense.inputs``)::

    ids:<col>       int64 [B, max_len]   one per schema id column (-1 = padding)
    dense           float32 [B, n_dense]
    vector:<col>    float32 [B, dim]     one per vector column
    scenario        int64 [B]
    mask            bool [B]
    unique:<table>  int64 [U_t]          sorted unique ids of the batch (>= 1 entry)
    rows:<table>    float32 [U_t, dim_t] their rows, looked up in the bundle's LMDB

Output: a tuple of probabilities ``[B]``, one per head (``dense.heads``), exactly
``model.predict(features, rows, unique_ids)``.

Tracing records one path through the model; :func:`trace_dense` therefore
checks the traced module against eager ``model.predict`` on a second example of
different batch size and id counts, and refuses to export if they differ.

A custom model (``[model] kind = "custom"``, :mod:`models.custom`) is traced the
same way: the bundle's ``dense.pt`` scores without the user's code. Why TorchScript
and not ``torch.export`` (tried on this wrapper; it fails on the lookup's
data-dependent checks and specializes shapes): docs/design/delivery.md, "Decisions".

Example::

    scripted, spec = trace_dense(model, schema)
    out = scripted(*flat_inputs(spec.inputs, features, unique_ids, rows))
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from torch import Tensor, nn

from delivery.bundle import DeliveryError
from meta_io.batch import FeatureBatch
from meta_io.schema import LIST_KINDS, PAD_ID, Schema

if TYPE_CHECKING:
    from models.base import CtrModel

_TOLERANCE = 1e-5


@dataclass(frozen=True)
class DenseSpec:
    """What the scripted module takes and returns (stored in the manifest)."""

    inputs: list[str]
    heads: list[str]
    tables: list[str]

    def to_dict(self) -> dict[str, list[str]]:
        return {"inputs": list(self.inputs), "heads": list(self.heads), "tables": list(self.tables)}


def input_names(schema: Schema, tables: Sequence[str]) -> list[str]:
    names = [f"ids:{c.name}" for c in schema.id_columns] + ["dense"]
    names += [f"vector:{c.name}" for c in schema.vector_columns]
    names += ["scenario", "mask"]
    for t in tables:
        names += [f"unique:{t}", f"rows:{t}"]
    return names


def flat_inputs(
    names: Sequence[str], features: FeatureBatch, unique_ids: dict[str, Tensor], rows: dict[str, Tensor]
) -> tuple[Tensor, ...]:
    """The flat tensors named by ``names`` (see the module docstring)."""
    out = []
    for name in names:
        kind, _, key = name.partition(":")
        try:
            if kind == "ids":
                out.append(features.ids[key])
            elif kind == "dense":
                out.append(features.dense)
            elif kind == "vector":
                out.append(features.vectors[key])
            elif kind == "scenario":
                out.append(features.scenario)
            elif kind == "mask":
                out.append(features.mask)
            elif kind == "unique":
                out.append(unique_ids[key])
            elif kind == "rows":
                out.append(rows[key])
            else:
                raise DeliveryError(f"dense input {name!r} is not a known input kind")
        except KeyError:
            raise DeliveryError(f"the batch has no '{key}' for dense input {name!r}") from None
    return tuple(out)


class _FlatPredict(nn.Module):
    """``model.predict`` over flat tensors (the module that gets traced)."""

    def __init__(self, model: CtrModel, names: list[str], heads: list[str]) -> None:
        super().__init__()
        self.model = model
        self.names = names
        self.heads = heads

    def forward(self, *flat: Tensor) -> tuple[Tensor, ...]:
        ids: dict[str, Tensor] = {}
        vectors: dict[str, Tensor] = {}
        uniq: dict[str, Tensor] = {}
        rows: dict[str, Tensor] = {}
        dense = scenario = mask = flat[0]
        for name, t in zip(self.names, flat):
            kind, _, key = name.partition(":")
            if kind == "ids":
                ids[key] = t
            elif kind == "vector":
                vectors[key] = t
            elif kind == "unique":
                uniq[key] = t
            elif kind == "rows":
                rows[key] = t
            elif kind == "dense":
                dense = t
            elif kind == "scenario":
                scenario = t
            elif kind == "mask":
                mask = t
        fb = FeatureBatch(ids=ids, dense=dense, vectors=vectors, labels={}, mask=mask, scenario=scenario)
        out = self.model.predict(fb, rows, uniq)
        return tuple(out[h] for h in self.heads)


def example_inputs(
    schema: Schema, dims: dict[str, int], rows: int, id_space: int, seed: int
) -> tuple[FeatureBatch, dict[str, Tensor], dict[str, Tensor]]:
    """A random batch of ``rows`` rows with its unique ids and random rows (for tracing)."""
    g = torch.Generator().manual_seed(seed)
    ids = {}
    for c in schema.id_columns:
        width = c.max_len if c.kind in LIST_KINDS else 1
        v = torch.randint(0, id_space, (rows, width), generator=g)
        if c.kind in LIST_KINDS and width > 1:
            v[:, width // 2 + 1 :] = PAD_ID  # exercise padding and mean pooling
        ids[c.name] = v
    fb = FeatureBatch(
        ids=ids,
        dense=torch.rand(rows, len(schema.dense_columns), generator=g),
        vectors={c.name: torch.randn(rows, c.dim, generator=g) for c in schema.vector_columns},
        labels={},
        mask=torch.ones(rows, dtype=torch.bool),
        scenario=torch.randint(0, 4, (rows,), generator=g),
    )
    uniq: dict[str, Tensor] = {}
    for c in schema.id_columns:
        t = c.table_name
        v = fb.ids[c.name].reshape(-1)
        uniq[t] = torch.cat([uniq[t], v]) if t in uniq else v
    uniq = {t: torch.unique(v[v >= 0]) for t, v in uniq.items()}
    table_rows = {t: torch.randn(u.numel(), dims[t], generator=g) * 0.1 for t, u in uniq.items()}
    return fb, uniq, table_rows


def trace_dense(model: CtrModel, schema: Schema, dims: dict[str, int]) -> tuple[torch.jit.ScriptModule, DenseSpec]:
    """Trace ``model.predict`` over flat inputs and verify it on a differently sized batch.

    Args:
        model: a ``models.base.CtrModel`` with its trained dense parameters loaded.
        schema: the data schema.
        dims: table -> embedding dim.

    Raises:
        DeliveryError: the traced module disagrees with eager ``model.predict``
            (the model has shape-dependent Python control flow).
    """
    model = model.eval()
    tables = list(getattr(model, "tables", schema.tables))
    names = input_names(schema, tables)
    fb, uniq, rows = example_inputs(schema, dims, rows=16, id_space=50, seed=1)
    heads = list(model.predict(fb, rows, uniq))
    wrapper = _FlatPredict(model, names, heads).eval()
    with warnings.catch_warnings():
        # The model's eager input checks (bool(tensor)) are not traced; the check below covers that.
        # TorchScript is in maintenance upstream but is still the self-contained serving format here
        # (torch.export fails on this wrapper: docs/design/delivery.md, "Decisions").
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        with torch.no_grad():
            scripted = torch.jit.trace(wrapper, flat_inputs(names, fb, uniq, rows), check_trace=False)
    fb2, uniq2, rows2 = example_inputs(schema, dims, rows=37, id_space=400, seed=2)
    with torch.no_grad():
        want = model.predict(fb2, rows2, uniq2)
        got = scripted(*flat_inputs(names, fb2, uniq2, rows2))
    for h, g in zip(heads, got):
        if g.shape != want[h].shape or not torch.allclose(g, want[h], atol=_TOLERANCE, rtol=0):
            raise DeliveryError(
                f"traced dense network disagrees with model.predict on head '{h}' for a batch of another size "
                f"(max abs diff {float((g - want[h]).abs().max()) if g.shape == want[h].shape else 'shape'}); "
                f"the model is not traceable"
            )
    return scripted, DenseSpec(inputs=names, heads=heads, tables=tables)


def save_scripted(module: torch.jit.ScriptModule, path: str) -> str:
    """Write ``module`` as TorchScript to ``path`` (what ``torch.jit.save`` writes); returns the
    sha256 of the bytes written (so the exporter need not read the file back to checksum it).

    Args:
        module: the scripted dense network.
        path: the ``dense.pt`` to write.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        data = module.save_to_buffer()  # (torch.jit.save to a file object writes these bytes)
    with open(path, "wb") as fh:
        fh.write(data)
    return hashlib.sha256(data).hexdigest()


def load_scripted(path: str) -> torch.jit.ScriptModule:
    """Load ``dense.pt`` (bytes first, so a truncated file is a clear error)."""
    try:
        with open(path, "rb") as fh, warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            module = torch.jit.load(io.BytesIO(fh.read()), map_location="cpu")
    except (RuntimeError, OSError) as exc:
        raise DeliveryError(f"{path}: cannot load the TorchScript dense network: {exc}") from None
    return module.eval()
