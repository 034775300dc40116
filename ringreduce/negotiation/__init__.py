"""Deciding, identically on every rank, which submitted ops are ready to run.

    module       what it owns
    coordinator  the decision: which ops run, or which error every rank raises
"""
