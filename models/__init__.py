"""CTR/CVR model zoo and the functional (G-Meta) meta-learning wrapper.

Models own dense parameters only; embedding rows gathered from the PS are
inputs of the forward. See docs/design/models.md and docs/design/meta_learning.md.
"""

from models.base import CtrModel
from models.config import BottomKind, ModelConfig, ModelKind
from models.factory import build_model
from models.losses import HeadSpec, heads_for_schema, loss

__all__ = [
    "BottomKind",
    "CtrModel",
    "HeadSpec",
    "ModelConfig",
    "ModelKind",
    "build_model",
    "heads_for_schema",
    "loss",
]
