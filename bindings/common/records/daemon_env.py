"""What the launcher tells Open MPI's daemons and the rank wrapper through the environment, so
that what they leave in the temporary folder is private and the user's program still gets the
user's own umask and TMPDIR (read by launcher/remote_guard.py and launcher/rank.py).
"""
import typing

# Open MPI's daemons run with umask 077, so that what they leave in /tmp is private whatever
# the user's umask; the rank wrapper gives the user's program the user's own umask back.
ENV_USER_UMASK = "MTRAIN_USER_UMASK"   # octal, e.g. "022"
DAEMON_UMASK = 0o077
# Open MPI's launcher names its folder in the temporary folder after its pid alone and will not
# start where that folder is already (one a killed launcher left, or another user planted):
# mpirun runs with TMPDIR set to the launch's private scratch folder, and the rank wrapper gives
# the program on that host the user's TMPDIR back.  (TMPDIR is not passed on to Open MPI's daemons
# on other hosts, which use the job's folders there: remote_guard.py; through Slurm the guard
# gives it back before it starts the daemon.)
ENV_MPIRUN_TMPDIR = "MTRAIN_MPIRUN_TMPDIR"   # the TMPDIR mpirun was given
ENV_USER_TMPDIR = "MTRAIN_USER_TMPDIR"       # the user's own; absent when the user had none
# Where Open MPI's launcher and daemons make their folders (TMPDIR's value, or /tmp, without it).
# PRRTE passes it on to the daemons it starts when mpirun has it, so only a daemon's own is set.
ENV_OPENMPI_SESSION_BASE = "PRTE_MCA_prte_tmpdir_base"


def restore_user_tmpdir(env: "typing.MutableMapping[str, str]") -> None:
    """The user's TMPDIR back in `env`, where mpirun's was given instead (and these notes out).
    Through Slurm, srun passes mpirun's environment to the other nodes, where that folder is not."""
    mpirun_tmpdir, user_tmpdir = env.pop(ENV_MPIRUN_TMPDIR, None), env.pop(ENV_USER_TMPDIR, None)
    if mpirun_tmpdir is not None and env.get("TMPDIR") == mpirun_tmpdir:
        if user_tmpdir is None:
            del env["TMPDIR"]
        else:
            env["TMPDIR"] = user_tmpdir
