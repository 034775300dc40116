"""Moving and reducing the bytes once every rank has agreed to run an op.

    module      what it does
    executor    the collectives, one at a time, choosing the path per size
    ring        pipelined ring collectives over MPI point-to-point
    shm         all-reduce through shared memory within a host, hierarchical across hosts
    library     the MPI library's own MPI_Allreduce, as one path among ours
    adasum      Adasum, Horovod's op=Adasum
    size_table  which path runs a buffer of a given size, measured at init
    backend     array helpers per kind of memory (NumPy host arrays, CuPy device arrays)
    cuda        CuPy device buffers, imported only when a CuPy array shows up
    comm        MPI setup: the world, local and cross communicators
    p2p         point-to-point transfers, matched in order
"""
