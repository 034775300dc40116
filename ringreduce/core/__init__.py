"""The runtime's shared types: no MPI, no engine, importable from anywhere in the runtime.

    module    what it holds
    ops       reduction operators, the collective kinds, the dtypes the runtime accepts
    errors    the errors an op can end with, and the verdicts of the negotiation
    requests  a submitted op (Request, Signature), its state, and what the user waits on
    log       the runtime's messages, filtered by the log level
"""
