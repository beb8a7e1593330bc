"""CTR/CVR model zoo and the functional (G-Meta) meta-learning wrapper.

Models own dense parameters only; embedding rows gathered from the PS are
inputs of the forward. See docs/design/models.md and docs/design/meta_learning.md.
"""

from models.base import CtrModel
from models.config import BottomKind, ModelConfig, ModelKind
from models.factory import build_model
from models.losses import HeadSpec, heads_for_schema, loss
from models.meta import AdaptTarget, MetaConfig, MetaStepResult, adapt_and_predict, assign_grads, meta_step, plain_step

__all__ = [
    "AdaptTarget",
    "BottomKind",
    "CtrModel",
    "HeadSpec",
    "MetaConfig",
    "MetaStepResult",
    "ModelConfig",
    "ModelKind",
    "adapt_and_predict",
    "assign_grads",
    "build_model",
    "heads_for_schema",
    "loss",
    "meta_step",
    "plain_step",
]
