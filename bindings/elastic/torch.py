"""``mtrain.elastic.torch``: the PyTorch elastic state and sampler, an import path kept for code
that uses it. They live with the torch binding, ``mtrain.torch.elastic`` (``hvd.elastic``), which
builds on this framework-free package; nothing here imports back the other way."""
from mtrain.torch.elastic import (  # noqa: F401  (re-exported)
    ElasticSampler,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    TorchState,
    run,
)

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State",
           "TorchState", "run"]
