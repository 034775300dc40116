"""load_module_file tells a file that is no module from a module that fails as it runs: the
launcher skips its early check of the runtime's settings only for the first."""
import pytest

from mtrain.launcher.cli.module_files import NotAModuleFile, load_module_file


def test_a_module_that_fails_as_it_runs_raises_its_own_error_and_is_not_kept(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_anywhere\n")
    with pytest.raises(ModuleNotFoundError) as raised:
        load_module_file("mtrain_test_broken_module", broken)
    assert not isinstance(raised.value, NotAModuleFile)
    with pytest.raises(ModuleNotFoundError):  # run again, not a half-made module from before
        load_module_file("mtrain_test_broken_module", broken)


def test_a_file_that_is_no_module_is_named(tmp_path):
    with pytest.raises(NotAModuleFile, match="cannot load"):
        load_module_file("mtrain_test_not_a_module", tmp_path / "data.txt")
