"""How both bindings read their op arguments, in one place: collectives' ``op``/``average``
and the reduction the DistributedOptimizers accept for gradients."""
from __future__ import annotations

from typing import Any, Optional

from mtrain.ringreduce import Adasum, Average, InvalidArgumentError, ReduceOp, Sum


def check_gradient_op(op: Any, gradient_predivide_factor: float, adasum: bool = False) -> ReduceOp:
    """Average or Sum, or Adasum where the caller runs it (``adasum``), as a ReduceOp; errors say
    what to use instead."""
    op = ReduceOp(op) if op in list(ReduceOp) else op
    if op not in ((Average, Sum, Adasum) if adasum else (Average, Sum)):
        # An op we do not reduce gradients with is refused as Horovod refuses the Adasum cases it
        # cannot run (NotImplementedError, a RuntimeError); InvalidArgumentError is also the
        # ValueError mtrain raised before.
        raise InvalidArgumentError(f"gradients are reduced here with op=Average or op=Sum, got {op!r}"
                                   + (" (Adasum runs in mtrain.torch's DistributedOptimizer and in "
                                      "DistributedGradientTape)" if op == Adasum else ""))
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor needs op=Average (it splits the averaging "
                         "into a division before and a multiplication after the sum)")
    if not gradient_predivide_factor > 0:
        raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor!r}")
    return op


def resolve_op(average: Optional[bool], op: Any) -> ReduceOp:
    """Horovod's deprecated ``average=`` flag, or ``op`` (default Average)."""
    if average is not None:
        if op is not None:
            raise ValueError("pass either op= or the deprecated average=, not both")
        return Average if average else Sum
    return Average if op is None else op
