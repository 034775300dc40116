"""mtrain.elastic: the rank side of elastic training (Horovod's ``hvd.elastic``).

Framework-free common part; ``mtrain.torch.elastic`` and ``mtrain.elastic.tensorflow``
add the framework states and are what ``hvd.elastic`` is in ``mtrain.torch`` and
``mtrain.tensorflow`` / ``mtrain.tensorflow.keras`` (``mtrain.elastic.torch`` re-exports
the torch one).

    state.commit()      keep the state (memory + this host's snapshot), check for new hosts
    @hvd.elastic.run    start from the newest commit any host holds; leave for the next
                        generation (exit status RESET_EXIT_STATUS) when the hosts change

The driver's side of the contract is in ``mtrain.common.records.elastic``.
"""
from .runner import run
from .state import HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "run"]
