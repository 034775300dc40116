"""The task relay: ranks started through tasks that hold a node's slots (Ray actors, Spark tasks).

    module        what it does
    service       a TaskService runs commands on its node for the launcher, in place of sshd
    agent         ``python -m mtrain.launcher.tasks.agent``: PRRTE's remote shell through a TaskService
    launch        an mtrain job whose nodes are reached through TaskServices
    call_service  the driver's CallServer: a Python function called in every rank, results in rank order
    call_worker   ``python -m mtrain.launcher.tasks.call_worker``: a rank that runs the driver's functions

``mtrain.ray`` and ``mtrain.spark`` use this package (and only this package of the launcher's).
"""
