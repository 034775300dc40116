"""Elastic jobs (``--min-np``, ``--max-np``, ``--host-discovery-script``): generations of mpirun.

    module  what it does
    driver  discover hosts, start each generation, blacklist failing hosts, count resets
"""
