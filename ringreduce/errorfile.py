"""This rank's account of a failure, for the launcher's root-cause report.

``mtrain run`` sets MTRAIN_ERROR_FILE for every rank; a JSON object written
there ({"time", "cause": "own"|"peer", "message"}) lets it name the rank where
a failure began rather than the ranks that failed because of it. The first
account a rank writes wins; without the variable nothing is written.
"""
from __future__ import annotations

import json
import os
import time


def record(message: str, cause: str) -> None:
    path = os.environ.get("MTRAIN_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump({"time": time.time(), "cause": cause, "message": message.splitlines()[0][:500]}, handle)
    except OSError:
        pass  # the report is a courtesy; never let it mask the real failure
