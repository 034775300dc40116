"""From a validated config to a running job: hosts, the MPI launcher's argv, the checks, the files.

    module       what it does
    launch       a LaunchConfig to a finished job: argv, dry run, preflight, supervision
    hosts        parse ``-H``, hostfiles and Slurm's node lists; assign slots (pure)
    layout       the JobLayout every rank is told (torchrun's variables, TF_CONFIG) (pure)
    mpirun       find the MPI launcher and build its command line (pure)
    environment  which environment variables the ranks receive (pure)
    netif        which local subnet reaches the remote hosts
    preflight    check every remote host before any rank starts
    slurm        inside an allocation: the nodes reached through Slurm, never SSH
    job_files    what a job keeps on each host, where, and how it goes
"""
