"""Your own model (``[model] kind = "custom"``): the contract, the adapter, the build-time check.

A job names the class by import path (``[model] class = "my_towers:TwoTower"``,
:mod:`models.custom_import`). The class is one of:

* a plain ``torch.nn.Module`` built as ``cls(spec)`` from a :class:`ModelSpec`, whose
  ``forward(features, dense)`` takes ``features``: feature name -> ``[*L, width]`` (an id
  column's pooled embedding, a vector column projected to ``default_dim``) and ``dense``:
  ``[*L, n_dense]`` (``sign(x) * log1p(|x|)``), and returns a dict head -> logits ``[*L]``
  (float32, one entry per ``spec.heads``). :class:`CustomModel` wraps it: the lookup, pooling
  and vector projections are the adapter's, the rest is the user's module (``.net``);
* or a :class:`~models.base.CtrModel` subclass built as the zoo's are,
  ``cls(schema, config, dims, heads)``, implementing ``logits`` (or ``outputs``).

Either way workers, the meta inner loop (``torch.func.functional_call`` + ``vmap`` over the
model's parameters, :mod:`models.meta`), delivery and predict see one
:class:`~models.base.CtrModel`. ``L`` is any leading shape (``[B]``, ``[T, S]``): the
module must treat rows independently (no BatchNorm: running statistics break ``vmap`` over
tasks, and a 16-row support set's batch statistics are not the large batch's).

:func:`check_contract` runs once when the model is built, on a tiny synthetic batch (the
global RNG untouched), and raises :class:`ModelContractError` in one line naming the class,
the head and expected vs got: outputs not a dict, a missing or extra head, a wrong shape or
dtype, a non-finite logit, no gradient reaching the module's parameters or the embedding
rows, a buffer the forward changes (BatchNorm's running statistics), a failure under the
meta step's ``vmap``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor, nn

from common.errors import ConfigError
from common.log import kv
from meta_io.schema import Schema
from models.base import CtrModel
from models.config import ModelConfig
from models.features import EncodedFeatures
from models.losses import HeadSpec

log = logging.getLogger(__name__)

_CHECK_ROWS = 6
"""Rows of the synthetic plain batch :func:`check_contract` runs."""


class ModelContractError(ConfigError):
    """A ``[model] class`` breaks the custom-model contract (one line: class, head, expected vs got)."""


@dataclass(frozen=True)
class ModelSpec:
    """What a plain ``nn.Module`` custom model is constructed with: ``cls(spec)``.

    Args:
        features: feature name -> width of its ``[*L, width]`` input, schema order: every id column
            (its pooled embedding; width = its table's dim), then every vector column (projected to
            ``config.default_dim`` by a ``Linear`` the adapter owns).
        tables: id column -> the embedding table it reads.
        dense: the dense columns; the ``dense`` input is ``[*L, len(dense)]``, ``sign(x) * log1p(|x|)``.
        heads: the output heads, in order (one per label; ``heads[0]`` is the click, later heads are
            trained on ``click * label``: docs/design/models.md, "Heads and losses").
        task_key: the task (user) id column of the schema.
        config: the ``[model]`` section (``hidden``, ``dropout``, ``default_dim``, ``seed`` ...).

    The small-data knobs reach a custom model as they reach the zoo's: :attr:`dropout` is
    ``[model] dropout`` (the module applies it where it likes, e.g. ``nn.Dropout(spec.dropout)``
    after its hidden layers: the meta step's ``vmap`` draws a different mask per task, and
    scoring, evaluation and export run the model in eval mode, so it is off there); L2 weight
    decay is the dense optimizer's (``[ps] dense_optimizer.weight_decay``) and needs nothing
    from the module.

    Example::

        class Logistic(nn.Module):
            def __init__(self, spec: ModelSpec) -> None:
                super().__init__()
                self.heads = list(spec.heads)
                self.drop = nn.Dropout(spec.dropout)
                self.out = nn.Linear(sum(spec.features.values()) + len(spec.dense), len(spec.heads))
            def forward(self, features: dict[str, Tensor], dense: Tensor) -> dict[str, Tensor]:
                z = self.out(self.drop(torch.cat([*features.values(), dense], dim=-1)))
                return {h: z[..., i] for i, h in enumerate(self.heads)}
    """

    features: dict[str, int]
    tables: dict[str, str]
    dense: list[str]
    heads: list[str]
    task_key: str
    config: ModelConfig

    @property
    def dropout(self) -> float:
        """``[model] dropout``: the dropout probability the module should apply in training (0 = none)."""
        return float(self.config.dropout)


class CustomModel(CtrModel):
    """A plain ``nn.Module`` written against :class:`ModelSpec`, as a :class:`~models.base.CtrModel`.

    Args:
        schema, config, dims, heads: see :class:`~models.base.CtrModel`.
        net_cls: the user's class; ``net_cls(spec)`` is the module (``self.net``).

    Example::

        model = CustomModel(schema, cfg, dims, heads_for_schema(schema), TwoTower)
        out = model(batch.features, rows, batch.unique_ids)   # {"click": [B], "conversion": [B]}
    """

    def __init__(self, schema: Schema, config: ModelConfig, dims: dict[str, int], heads: Sequence[HeadSpec],
                 net_cls: Any) -> None:
        super().__init__(schema, config, dims, heads)
        features = {c.name: dims[c.table_name] for c in schema.id_columns}
        features.update({name: config.default_dim for name in self.encoder.vector_columns})
        self.spec = ModelSpec(features=features, tables={c.name: c.table_name for c in schema.id_columns},
                              dense=list(self.encoder.dense_columns), heads=[h.name for h in self.heads],
                              task_key=schema.task_key, config=config)
        self.net: nn.Module = net_cls(self.spec)
        self._order = list(features)

    def net_inputs(self, enc: EncodedFeatures) -> tuple[dict[str, Tensor], Tensor]:
        """The user's module's inputs from the encoded batch: (feature name -> ``[*L, width]``, dense)."""
        got: dict[str, Tensor] = {}
        for lay, pooled in zip(self.layouts, enc.pooled):
            for i, col in enumerate(lay.columns):
                got[col] = pooled[..., i, :]
        got.update(zip(self.encoder.vector_columns, enc.vectors))
        return {name: got[name] for name in self._order}, enc.dense

    def outputs(self, enc: EncodedFeatures, probabilities: bool) -> dict[str, Tensor]:
        features, dense = self.net_inputs(enc)
        out = self.net(features, dense)
        z = {h.name: out[h.name] for h in self.heads}
        return {k: torch.sigmoid(v) for k, v in z.items()} if probabilities else z


def build_custom(schema: Schema, cfg: ModelConfig, dims: dict[str, int], heads: Sequence[HeadSpec]) -> CtrModel:
    """The model ``[model] class`` names, wrapped when it is a plain module (not yet checked).

    Raises:
        ConfigError: not importable (:func:`models.custom_import.import_model_class`).
        ModelContractError: not a class of ``nn.Module``, or its constructor raised.
    """
    from models.custom_import import import_model_class

    name = cfg.class_path
    cls = import_model_class(cfg.class_path, cfg.class_dir)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ModelContractError(f"model.class {name!r}: expected a torch.nn.Module subclass (or a CtrModel "
                                 f"subclass), got {type(cls).__name__} {cls!r}"[:300])
    try:
        if issubclass(cls, CtrModel):
            return cls(schema, cfg, dims, heads)
        return CustomModel(schema, cfg, dims, heads, cls)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 -- the user's constructor: one line naming it
        how = f"{name}(schema, config, dims, heads)" if issubclass(cls, CtrModel) else f"{name}(spec)"
        raise ModelContractError(f"model.class {name!r}: {how} raised {type(exc).__name__}: {_first(exc)}") from None


def _first(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else ""


def _user_module(model: CtrModel) -> nn.Module:
    return model.net if isinstance(model, CustomModel) else model


def _raw_outputs(model: CtrModel, fb: Any, rows: dict[str, Tensor], uniq: dict[str, Tensor]) -> Any:
    """What the user's code returns on a batch: the plain module's dict, or a subclass's outputs."""
    if isinstance(model, CustomModel):
        enc = model.encoder(fb, rows, model.lookup_index(fb, uniq, rows))
        return model.net(*model.net_inputs(enc))
    return model(fb, rows, uniq)


def _check_outputs(name: str, out: Any, heads: Sequence[str], lead: list[int]) -> None:
    if not isinstance(out, Mapping):
        raise ModelContractError(f"model.class {name!r}: forward must return a dict head -> logits, got "
                                 f"{type(out).__name__}" + (f" of shape {list(out.shape)}" if isinstance(out, Tensor) else ""))
    missing = [h for h in heads if h not in out]
    extra = sorted(str(k) for k in out if k not in heads)
    if missing or extra:
        raise ModelContractError(f"model.class {name!r}: heads expected {list(heads)}, got {sorted(map(str, out))}"
                                 + (f" (missing {missing})" if missing else "") + (f" (extra {extra})" if extra else ""))
    for h in heads:
        z = out[h]
        if not isinstance(z, Tensor):
            raise ModelContractError(f"model.class {name!r}: head {h!r}: expected a Tensor, got {type(z).__name__}")
        if list(z.shape) != lead:
            raise ModelContractError(f"model.class {name!r}: head {h!r}: expected logits of shape {lead} "
                                     f"(one per row), got {list(z.shape)}")
        if z.dtype != torch.float32:
            raise ModelContractError(f"model.class {name!r}: head {h!r}: expected dtype float32, got {z.dtype}")
        if not bool(torch.isfinite(z).all()):
            raise ModelContractError(f"model.class {name!r}: head {h!r}: non-finite logits on a synthetic batch "
                                     f"({int((~torch.isfinite(z)).sum())} of {z.numel()})")


def check_contract(model: CtrModel, schema: Schema, dims: dict[str, int]) -> None:
    """Run the user's model once on tiny synthetic batches and check the contract (module docstring).

    The global RNG, the parameters and their ``.grad`` are left as they were.

    Args:
        model: the built model (:func:`build_custom`).
        schema: the data schema.
        dims: table -> embedding dim.

    Raises:
        ModelContractError: one line naming the class, the head, expected vs got.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        _check(model, schema, dims)


def _check(model: CtrModel, schema: Schema, dims: dict[str, int]) -> None:
    from models.meta import meta_step
    from models.meta_config import AdaptTarget, MetaConfig
    from models.testing import random_features, random_meta_batch, random_rows, unique_ids_of

    name = model.config.class_path or type(model).__name__
    heads = [h.name for h in model.heads]
    user = _user_module(model)
    for mod_name, mod in user.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            raise ModelContractError(f"model.class {name!r}: {mod_name or 'the module'} is a {type(mod).__name__}: "
                                     f"rows must be computed independently (its statistics mix rows and break "
                                     f"vmap over meta tasks); use LayerNorm or no normalization")
    g = torch.Generator().manual_seed(0)
    for lead in ([_CHECK_ROWS], [2, 3]):
        fb = random_features(schema, tuple(lead), vocab=20, generator=g, pad_rows=0.0)
        uniq = unique_ids_of(schema, fb)
        rows = {t: r.requires_grad_(True) for t, r in random_rows(uniq, dims, generator=g).items()}
        buffers = {k: b.clone() for k, b in user.named_buffers()}
        try:
            out = _raw_outputs(model, fb, rows, uniq)
        except ModelContractError:
            raise
        except Exception as exc:  # noqa: BLE001 -- the user's forward: one line naming it
            raise ModelContractError(f"model.class {name!r}: forward failed on a synthetic batch of leading shape "
                                     f"{lead}: {type(exc).__name__}: {_first(exc)}") from None
        _check_outputs(name, out, heads, lead)
        changed = [k for k, b in user.named_buffers() if k in buffers and not torch.equal(b, buffers[k])]
        if changed:
            raise ModelContractError(f"model.class {name!r}: forward changes buffer(s) {changed} (running statistics): "
                                     f"they break vmap over meta tasks and make rows depend on each other")
    total = torch.stack([out[h].sum() for h in heads]).sum()
    params = [p for p in user.parameters() if p.requires_grad]
    if not total.requires_grad:
        raise ModelContractError(f"model.class {name!r}: outputs are not differentiable (no autograd graph: "
                                 f"computed under no_grad, detached, or through numpy?)")
    got = torch.autograd.grad(total, params + list(rows.values()), allow_unused=True)
    if params and all(gr is None for gr in got[: len(params)]):
        raise ModelContractError(f"model.class {name!r}: no gradient reaches its parameters "
                                 f"({len(params)} tensors): the logits do not depend on them")
    if all(gr is None for gr in got[len(params):]):
        raise ModelContractError(f"model.class {name!r}: no gradient reaches the embedding rows: the logits do "
                                 f"not depend on any id feature, so the PS tables would never train")
    unused = [n for (n, p), gr in zip(((n, p) for n, p in user.named_parameters() if p.requires_grad), got) if gr is None]
    if unused:
        log.warning("custom model parameters get no gradient", extra=kv(model=name, params=",".join(unused[:8])))
    mb = random_meta_batch(schema, tasks=2, support=3, query=3, vocab=20, generator=g, pad_rows=0.0)
    meta_rows = random_rows(mb.unique_ids, dims, generator=g)
    try:
        meta_step(model, mb, meta_rows, MetaConfig(inner_steps=1, inner_lr=0.1, adapt=AdaptTarget.BOTH, first_order=True),
                  diagnostics=False)
    except Exception as exc:  # noqa: BLE001 -- torch.func's own error, in one line
        raise ModelContractError(f"model.class {name!r}: fails in the meta step (torch.func functional_call + "
                                 f"vmap over tasks): {type(exc).__name__}: {_first(exc)}") from None
