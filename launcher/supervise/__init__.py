"""Watching a running job and saying how it ended.

    module       what it does
    supervisor   run one job under the MPI launcher: relay output, watch, stop, explain
    outcome      the first failure, the failure report, the exit status
    output       the ranks' lines and mtrain's own, to the terminal and --output-filename
    progress     ``--progress``: where the job is, on one line
    stragglers   which rank is slow: the straggler table
    hang_report  where a stuck job is: every rank's flight recorder in one table
"""
