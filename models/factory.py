"""``build_model(schema, cfg)``: the one way the worker and delivery build a model.

A zoo kind is a class of this package; ``kind = "custom"`` is the user's class
(:mod:`models.custom`), built the same way and checked against the contract before
it is returned, so every process that builds it (worker, train-local, deliver, adapted
serving, preflight) refuses a broken model in the same one line.
"""

from __future__ import annotations

import logging

import torch

from meta_io.schema import Schema
from models.base import CtrModel
from models.config import ModelConfig, ModelKind
from models.dcn import DCNv2
from models.deepfm import DeepFM
from models.dnn import WideDeep
from models.esmm import ESMM
from models.losses import heads_for_schema
from common.log import kv

log = logging.getLogger(__name__)

_MODELS: dict[ModelKind, type[CtrModel]] = {
    ModelKind.DNN: WideDeep,
    ModelKind.DEEPFM: DeepFM,
    ModelKind.DCNV2: DCNv2,
    ModelKind.ESMM: ESMM,
}


def build_model(schema: Schema, cfg: ModelConfig) -> CtrModel:
    """Build the configured model for ``schema``, with a deterministic init.

    Dims come from ``cfg.embedding_dims(schema.tables)``; the PS tables must use
    the same. Parameters depend only on ``(schema, cfg)`` (``cfg.seed``), not on
    the global RNG, which is left untouched.

    Args:
        schema: the data schema (features, labels).
        cfg: the ``[model]`` config.

    Example::

        model = build_model(schema, ModelConfig(kind="esmm", bottom="mmoe"))
        model.dims    # table -> dim, for the PS
        model.heads   # [HeadSpec('click', ...), HeadSpec('conversion', ..., gate='click')]

    Raises:
        ConfigError: a custom class that is not importable; ``models.custom.ModelContractError``
            (a ConfigError) when it breaks the contract.
    """
    cfg.validate()
    dims = cfg.embedding_dims(schema.tables)
    kind = ModelKind(cfg.kind)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        if kind == ModelKind.CUSTOM:
            from models.custom import build_custom

            model = build_custom(schema, cfg, dims, heads_for_schema(schema))
        else:
            model = _MODELS[kind](schema, cfg, dims, heads_for_schema(schema))
    if kind == ModelKind.CUSTOM:
        from models.custom import check_contract

        check_contract(model, schema, dims)
    n = sum(p.numel() for p in model.parameters())
    log.info("built model", extra=kv(kind=kind.value, dense_params=n, tables=len(dims),
                                     **({"cls": cfg.class_path} if cfg.class_path else {})))
    return model
