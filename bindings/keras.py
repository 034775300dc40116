"""``import mtrain.keras as hvd`` in place of ``import horovod.keras as hvd``: the same module as
``mtrain.tensorflow.keras`` (Keras 3, or Keras 2 through tf_keras under ``TF_USE_LEGACY_KERAS=1``)."""
from .tensorflow.keras import *  # noqa: F401,F403
from .tensorflow.keras import DistributedOptimizer, callbacks, elastic  # noqa: F401
