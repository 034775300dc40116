"""``import mtrain.keras as hvd`` in place of ``import horovod.keras as hvd`` (Keras 3 is tf.keras)."""
from .tensorflow.keras import *  # noqa: F401,F403
from .tensorflow.keras import DistributedOptimizer, callbacks, elastic  # noqa: F401
