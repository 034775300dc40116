"""What the runtime tells about itself: timeline, flight recorder, step timings, autotuning.

    module    what it does
    timeline  Chrome-trace timeline of every op on every rank
    recorder  the flight recorder: each engine's last collectives, dumped when a job seems stuck
    steps     per-step timings of one rank, for the straggler report
    autotune  Horovod's ``--autotune`` for the engine
    optim     the autotuner's Bayesian optimisation
"""
