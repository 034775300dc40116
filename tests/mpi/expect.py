"""What an MPI test body expects of an error: its type, and fragments of its text."""
import pytest

import mtrain.ringreduce as rr


def raises(fn, kind, *fragments) -> str:
    """Call `fn`, which must raise `kind` with every fragment in its text; the text."""
    with pytest.raises(kind) as info:
        fn()
    text = str(info.value)
    for fragment in fragments:
        assert fragment in text, f"rank {rr.rank()}: {fragment!r} not in error: {text}"
    return text
