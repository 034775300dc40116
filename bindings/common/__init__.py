"""What both halves of mtrain share: the contracts that cross a process boundary.

The runtime inside every rank (``mtrain.ringreduce``), the launcher (``mtrain.launcher``) and the
bindings import these modules; they import nothing of mtrain but each other, and only the
standard library, because they run in ranks, SSH agents, remote guards and the CLI alike.

    module / package   what it holds
    records/           the records written by one side and read by the other (one module per record)
    private            the rules for files and folders mtrain leaves in shared places (/tmp, /dev/shm)
    settings           the settings table: every MTRAIN_*/HOROVOD_* variable, its default and its parser
    straggler_rows     the straggler table's rows, from every rank's measured steps
    exit_status        how a rank's exit status reaches the runtime's exit handler (the rank runner sets it)

Nothing is imported here: each side imports only the modules it needs, to start fast.
"""
