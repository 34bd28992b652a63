"""Models (flax.linen): a registry beside one module per model family, one knob system.

- ``registry``: ``register_model``, ``registered_models``, ``model_spec``, ``make_model`` and
  ``ModelConfig``, the gin ``model`` configurable: the ``model.*`` knobs, the one knob system
  of dpbench's own models.
- ``layers``: image patches, ``PatchConv``, the 2x2 max pool, the per-example input GroupNorm.
- ``losses``: the per-example loss, ``logits_loss``, ``through_a_dot``, ``accuracy``.
- The models, each registering itself as a user's plug-in would: ``tanh_cnn`` (``tanh_cnn``),
  ``mlp`` and ``logistic`` (``dense``), ``scatter_linear`` and ``scatter_cnn`` (``scatter``),
  ``wrn`` (``wide_resnet``).

Never BatchNorm: it mixes examples and breaks per-example sensitivity; GroupNorm is the only
normalization offered. Importing this package registers every model of dpbench's own.
"""

from dpbench.models.layers import (ACTIVATIONS, PatchConv, _patches_by_blocks,
                                   _patches_by_slices, conv_layer, image_patches,
                                   input_group_norm, max_pool_2x2_stride_1)
from dpbench.models.losses import accuracy, cross_entropy_loss, logits_loss, through_a_dot
from dpbench.models.registry import (ModelConfig, ModelSpec, make_model, model_spec,
                                     register_model, registered_models)
from dpbench.models.dense import MLP, Logistic
from dpbench.models.scatter import ScatterCNN, ScatterLinear
from dpbench.models.tanh_cnn import TanhCNN
from dpbench.models.wide_resnet import WideResNet

# dpbench's own models built from model.* defaults alone (``wrn`` needs model.group_norm_groups)
MODELS = ("tanh_cnn", "mlp", "logistic", "scatter_linear", "scatter_cnn")
# The features (dataset.features) a built-in model needs when not pixels (mlp, logistic: any).
REQUIRED_FEATURES = {"scatter_linear": "scattering", "scatter_cnn": "scattering"}
