"""Deciding, identically on every rank, which submitted ops are ready to run.

An op is ready when every rank has submitted it (matched by name) with the same signature.
The steady state needs one small all-reduce per cycle (the vector); new names go to rank 0's
coordinator once, and are cached from then on.

    module       what it owns
    vector       the negotiation vector: its layout, how a rank fills it, the exchange, what it means
    cache        the response cache: name ⇄ bit, identical on every rank
    coordinator  rank 0's decisions on ops not cached: ready, mismatch, refused, invalidated, stalled
    messages     what a coordinator round carries: each rank's Gathered reports, rank 0's Responses
    stall        the stall inspector: which ops some ranks submitted long ago and others not yet
    steady       the steady batch: a step that repeats the cached ops of a step before
"""
