"""CTR/CVR model zoo and the functional (G-Meta) meta-learning wrapper.

Models own dense parameters only; embedding rows gathered from the PS are
inputs of the forward. A job may name a model of its own (``[model] kind = "custom"``,
:mod:`models.custom`). See docs/design/models.md and docs/design/meta_learning.md.
"""

import importlib
from typing import Any

# Exports resolve lazily (PEP 562): `import models.config` must not import torch,
# because every fleet process parses the job file before it needs a model.
_EXPORTS = {
    "CtrModel": "models.base",
    "BottomKind": "models.config",
    "ModelConfig": "models.config",
    "ModelKind": "models.config",
    "build_model": "models.factory",
    "CustomModel": "models.custom",
    "ModelContractError": "models.custom",
    "ModelSpec": "models.custom",
    "HeadSpec": "models.losses",
    "heads_for_schema": "models.losses",
    "loss": "models.losses",
    "AdaptTarget": "models.meta_config",
    "MetaConfig": "models.meta_config",
    "MetaStepResult": "models.meta",
    "adapt_and_predict": "models.meta",
    "assign_grads": "models.meta",
    "meta_step": "models.meta",
    "plain_step": "models.meta",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
