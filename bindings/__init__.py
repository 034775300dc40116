"""mtrain: Horovod-style data-parallel training in pure Python.

``import mtrain.torch as hvd``, ``import mtrain.tensorflow as hvd``,
``import mtrain.tensorflow.keras as hvd`` or ``import mtrain.keras as hvd`` in
place of the matching ``horovod.*`` module; launch with ``mtrain run`` instead
of ``horovodrun``. The runtime is ``mtrain.ringreduce``, the launcher
``mtrain.launcher``.

This module stays free of imports: every rank, SSH agent and remote probe
imports it first.
"""

__version__ = "0.1.0"
