"""`mtrain run`'s options reach the launcher as one RunOptions: a field for every click
parameter of the command, so an option added to one and not the other fails here, not as an
internal error at a user's first run."""
import dataclasses

from mtrain.launcher.cli import main as cli
from mtrain.launcher.cli.run_options import RunOptions


def test_every_run_parameter_has_a_field_and_no_field_is_left_over():
    parameters = {p.name for p in cli.run.params if p.expose_value}
    fields = {f.name for f in dataclasses.fields(RunOptions)}
    assert parameters - fields == set(), "click parameters without a RunOptions field"
    assert fields - parameters == set(), "RunOptions fields no click parameter fills"
