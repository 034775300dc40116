"""Framework adapters: ``bindings.torch`` and ``bindings.tensorflow`` (with ``bindings.keras``).

Each is a drop-in for the matching Horovod module: change the import line,
launch with ``mtrain run`` instead of ``horovodrun``.
"""
