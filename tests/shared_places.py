"""What is in the places every user of a host shares (/tmp, /dev/shm), for the tests that check
mtrain leaves nothing there that another user could read or plant."""
from __future__ import annotations

import os
from typing import Callable

SHARED = ("/tmp", "/dev/shm")


def shared_entries(wanted: "Callable[[str, os.stat_result], bool]") -> "dict[str, int]":
    """Every entry of /tmp and /dev/shm that `wanted(path, lstat)` takes, with everything inside
    it: path -> mode (what vanishes while it is read is left out)."""
    found = {}
    for base in SHARED:
        for name in os.listdir(base):
            top = os.path.join(base, name)
            try:
                if not wanted(top, os.lstat(top)):
                    continue
            except FileNotFoundError:
                continue
            for folder, folders, files in os.walk(top):
                for path in [folder, *(os.path.join(folder, n) for n in folders + files)]:
                    try:
                        found[path] = os.lstat(path).st_mode
                    except FileNotFoundError:
                        pass
    return found
