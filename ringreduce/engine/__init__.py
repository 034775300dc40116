"""The background engine: ops come in from the user's threads, cycles run them.

    module        what it does
    submit        one op's way in: its arguments checked once, then queued or refused
    submit_queue  everything of an engine that the user's threads touch
    cycle         the engine cycle: one at a time owns every MPI call of the runtime
    dispatch      runs the ops a cycle made ready, and ends every op
    fusion        which ready all-reduces share a buffer, and the buffers
    join          ``hvd.join()``: a rank with no more data stands in for the others' ops
"""
