"""mtrain's launcher: `mtrain run` starts, watches and stops the ranks of a job.

Importing this package is cheap on purpose: every rank and every remote host
imports it (the rank wrapper, the remote guard, the preflight probe), so it
must not pull in paramiko, click or any deep-learning framework.
"""

from mtrain import __version__  # noqa: F401  (one version, kept in mtrain/__init__.py)
