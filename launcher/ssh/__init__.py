"""Reaching hosts over SSH (paramiko), and the framed wire the launcher's relays share.

    module       what it does
    client       resolve, verify and connect like OpenSSH; run commands (the only paramiko user)
    master       one authenticated connection per host, shared by the preflight and the agents
    agent        ``python -m mtrain.launcher.ssh.agent``: mtrain's stand-in for ``ssh`` under mpirun
    stream_pump  copy a remote stream to where it goes, taking the remote guard's events out
    wire         kind-tagged, length-prefixed frames on a stream socket (the SSH master's and the tasks' relays)
"""
