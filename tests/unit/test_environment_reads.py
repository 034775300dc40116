"""One configuration regime: the runtime reads its MTRAIN_* and HOROVOD_* settings through the
table in bindings/common/settings.py (``Setting.read``), never from the environment itself.

``test_the_runtime_reads_no_setting_itself`` scans ringreduce/ statically: a read of the
environment (``os.environ.get(K)``, ``os.environ[K]``, ``K in os.environ``, ``os.getenv(K)``,
and the same on an environment handed over as an argument) whose key K is an ``MTRAIN_*`` or
``HOROVOD_*`` name -- a literal, a constant of this or another of mtrain's modules, an f-string,
a Setting's ``.ours`` / ``.horovod`` -- is an offence; so is a read of ``os.environ`` whose key the
scan cannot tell. What stays a direct read, by design:

* variables of the libraries the runtime runs on, which no setting of ours stands for: MPI's
  and PMIx's (``OMPI_*``, ``PMIX_RANK``, ``PMI_*``: whether a launcher started this process),
  Slurm's (``SLURM_*``), CUDA's ``CUDA_VISIBLE_DEVICES``, the XDG cache folder;
* what ``mtrain run`` hands each rank (the job's files and marker fd, elastic state, its key):
  a contract of the launcher's, not a setting (docs/configuration.md), each read by the one
  module of mtrain.common.records that owns it (``records.error_report.supervised``, ...).

The second half checks that the observability settings moved into the table read as they
always did (lenient: a bad value is the default; the flight recorder's says so on stderr).
"""
from __future__ import annotations

import ast
import functools
import math
from pathlib import Path
from typing import Any

import pytest

from mtrain.common import settings
from tests.unit.source_modules import REPO, import_source, installed_modules, module_name

PREFIXES = ("MTRAIN_", "HOROVOD_")
SCANNED = ("ringreduce",)
UNKNOWN = object()  # a key the scan cannot tell


def module_constants(tree: ast.Module) -> "dict[str, Any]":
    """A module's top-level ``NAME = "text"`` and ``NAME = ("text", ...)`` constants."""
    found: "dict[str, Any]" = {}
    for statement in tree.body:
        if isinstance(statement, (ast.Assign, ast.AnnAssign)) and statement.value is not None:
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            try:
                value = ast.literal_eval(statement.value)
            except ValueError:
                continue
            for target in targets:
                if isinstance(target, ast.Name) and isinstance(value, (str, tuple)):
                    found[target.id] = value
    return found


@functools.lru_cache(maxsize=None)
def all_constants() -> "dict[str, dict[str, Any]]":
    return {name: module_constants(ast.parse(path.read_text())) for name, path in installed_modules().items()}


class Reads(ast.NodeVisitor):
    """The environment reads in one module whose key names one of our settings, or cannot be told."""

    def __init__(self, tree: ast.Module, here: str, is_package: bool, constants: "dict[str, dict[str, Any]]") -> None:
        self.own = module_constants(tree)
        self.names: "dict[str, Any]" = {}    # name bound by an import -> (module, attribute) or module
        self.loops: "dict[str, ast.expr]" = {}  # a loop's or comprehension's variable -> what it runs over
        self.constants = constants
        self.found: "list[tuple[int, str]]" = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = import_source(here, is_package, node)
                for alias in node.names:
                    self.names[alias.asname or alias.name] = (source, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    self.names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                        alias.name.split(".")[0]
            elif isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
                self.loops[node.target.id] = node.iter
        self.visit(tree)

    # -- what a key is ---------------------------------------------------------------------

    def value(self, node: ast.expr, depth: int = 0) -> Any:
        """The key's text, a tuple of texts (a loop over them), or UNKNOWN."""
        if depth > 5:
            return UNKNOWN
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return tuple(self.value(element, depth + 1) for element in node.elts)
        if isinstance(node, ast.JoinedStr):
            first = node.values[0] if node.values else None
            return first.value + "{...}" if isinstance(first, ast.Constant) else UNKNOWN
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left = self.value(node.left, depth + 1)
            return left + "..." if isinstance(left, str) else UNKNOWN
        if isinstance(node, ast.Name):
            if node.id in self.own:
                return self.own[node.id]
            if node.id in self.loops:
                return self.value(self.loops[node.id], depth + 1)
            bound = self.names.get(node.id)
            if isinstance(bound, tuple):
                module, name = bound
                return self.constants.get(module, {}).get(name, UNKNOWN)
            return UNKNOWN
        if isinstance(node, ast.Attribute):
            if node.attr in ("ours", "horovod"):  # a Setting's own variable
                return "MTRAIN_ (a Setting's variable)"
            owner = node.value
            if isinstance(owner, ast.Name):
                bound = self.names.get(owner.id)
                module = ".".join(bound) if isinstance(bound, tuple) else bound
                if module in self.constants:
                    return self.constants[module].get(node.attr, UNKNOWN)
            return UNKNOWN
        return UNKNOWN

    def ours(self, value: Any) -> bool:
        if isinstance(value, tuple):
            return any(self.ours(element) for element in value)
        return isinstance(value, str) and value.startswith(PREFIXES)

    def check(self, node: ast.AST, key: ast.expr, direct: bool) -> None:
        """``key`` read from an environment (``direct``: from ``os.environ`` / ``os.getenv`` itself)."""
        value = self.value(key)
        if self.ours(value) or (direct and value is UNKNOWN):
            shown = ast.unparse(key) + ("" if value is UNKNOWN else f" ({value!r})")
            self.found.append((node.lineno, shown))

    # -- where an environment is read ------------------------------------------------------

    def is_environ(self, node: ast.expr) -> bool:
        """``os.environ``, or ``environ`` imported from os."""
        if isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name):
            return self.names.get(node.value.id) == "os"
        return isinstance(node, ast.Name) and self.names.get(node.id) == ("os", "environ")

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if node.args and isinstance(func, ast.Attribute):
            if func.attr == "getenv" and isinstance(func.value, ast.Name) and self.names.get(func.value.id) == "os":
                self.check(node, node.args[0], True)
            elif func.attr in ("get", "pop", "setdefault", "__getitem__", "__contains__"):
                self.check(node, node.args[0], self.is_environ(func.value))
        elif node.args and isinstance(func, ast.Name) and self.names.get(func.id) == ("os", "getenv"):
            self.check(node, node.args[0], True)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, ast.Load):
            self.check(node, node.slice, self.is_environ(node.value))
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        left = node.left
        for op, right in zip(node.ops, node.comparators):
            if isinstance(op, (ast.In, ast.NotIn)):
                self.check(node, left, self.is_environ(right))
            left = right
        self.generic_visit(node)


def reads_in(text: str, where: str, here: str, is_package: bool = False,
             constants: "dict[str, dict[str, Any]] | None" = None) -> "list[str]":
    reads = Reads(ast.parse(text, where), here, is_package, all_constants() if constants is None else constants)
    return [f"{where}:{line} reads {key} from the environment itself" for line, key in reads.found]


def offenders(folders: "tuple[str, ...]" = SCANNED) -> "list[str]":
    constants = all_constants()
    return [line for folder in folders for path in sorted((REPO / folder).rglob("*.py"))
            for line in reads_in(path.read_text(), str(path.relative_to(REPO)), module_name(path),
                                 path.name == "__init__.py", constants)]


def test_the_runtime_reads_no_setting_itself():
    found = offenders()
    assert not found, ("read these through a Setting of bindings/common/settings.py (Setting.read):\n"
                       + "\n".join(found))


@pytest.mark.parametrize("code, bad", [
    ("import os\nos.environ.get('MTRAIN_FLIGHT_RECORDER_SIZE', '')\n", True),
    ("import os\ndef f():\n    return os.environ['HOROVOD_CYCLE_TIME']\n", True),
    ("import os\nx = 'MTRAIN_X' in os.environ\n", True),
    ("import os\nos.getenv('HOROVOD_TIMELINE')\n", True),
    ("from os import environ, getenv\nenviron.get('MTRAIN_A')\ngetenv('MTRAIN_B')\n", True),
    ("import os\nNAME = 'MTRAIN_FOO'\nos.environ.get(NAME)\n", True),
    ("import os\nfrom mtrain.common.records.flight_recorder import ENV_FLIGHT_RECORDER_SIZE as E\n"
     "os.environ.get(E, '')\n", True),
    ("import os\nfrom mtrain.common.records import steps\nos.environ.get(steps.ENV_STRAGGLER_EVERY)\n", True),
    ("import os\nfrom mtrain.common import settings\nos.environ.get(settings.TIMELINE.ours)\n", True),
    ("import os\ndef f(kind):\n    return os.environ.get(f'MTRAIN_{kind}')\n", True),
    ("import os\ndef f(name):\n    return os.environ.get(name)\n", True),  # cannot tell: refused
    ("def f(env):\n    return env.get('MTRAIN_STALL_CHECK_DISABLE')\n", True),  # an environment handed over
    ("import os\nNAMES = ('OMPI_COMM_WORLD_SIZE', 'MTRAIN_X')\nany(k in os.environ for k in NAMES)\n", True),
    # The reads that stay direct: other libraries' variables; and the settings table.
    ("import os\nNAMES = ('OMPI_COMM_WORLD_SIZE', 'PMIX_RANK')\nany(k in os.environ for k in NAMES)\n", False),
    ("import os\nos.environ.get('CUDA_VISIBLE_DEVICES', '')\nos.environ['OMPI_MCA_btl'] = 'self'\n", False),
    ("def f(env):\n    return env.get('SLURM_STEP_NUM_TASKS', '')\n", False),
    ("from mtrain.common import settings\nsettings.FLIGHT_RECORDER_SIZE.read()\n", False),
])
def test_the_scan_sees_a_direct_read(code, bad):
    found = reads_in(code, "probe.py", "mtrain.ringreduce.observe.probe")
    assert bool(found) is bad, found


# -- the observability settings read as they always did ------------------------------------------

@pytest.mark.parametrize("text, size, said", [
    (None, 256, False), ("", 256, False), ("  ", 256, False), ("0", 0, False), ("17", 17, False), (" 17 ", 17, False),
    ("-3", 0, False), ("abc", 256, True), ("1.5", 256, True),
])
def test_the_flight_recorder_size(monkeypatch, capsys, text, size, said):
    from mtrain.ringreduce.observe import recorder
    if text is None:
        monkeypatch.delenv("MTRAIN_FLIGHT_RECORDER_SIZE", raising=False)
    else:
        monkeypatch.setenv("MTRAIN_FLIGHT_RECORDER_SIZE", text)
    assert recorder.size_from_environment() == size
    err = capsys.readouterr().err
    if said:
        assert err == (f"mtrain: MTRAIN_FLIGHT_RECORDER_SIZE={text.strip()!r} is not a whole number; using 256 "
                       "(set it to 0 to turn the flight recorder off)\n")
    else:
        assert err == ""


@pytest.mark.parametrize("setting, text, value", [
    (settings.STEP_REPORT_STEPS, None, 1000), (settings.STEP_REPORT_STEPS, "5", 5),
    (settings.STEP_REPORT_STEPS, "0", 1000), (settings.STEP_REPORT_STEPS, "-1", 1000),
    (settings.STEP_REPORT_STEPS, "often", 1000), (settings.STEP_REPORT_STEPS, "2.0", 1000),
    (settings.STEP_REPORT_SECONDS, None, 30.0), (settings.STEP_REPORT_SECONDS, "2.5", 2.5),
    (settings.STEP_REPORT_SECONDS, "0", 30.0), (settings.STEP_REPORT_SECONDS, "-1", 30.0),
    (settings.STEP_REPORT_SECONDS, "nan", 30.0), (settings.STEP_REPORT_SECONDS, "x", 30.0),
    (settings.STEP_REPORT_SECONDS, "inf", math.inf),
    (settings.STRAGGLER_REPORT_DISABLE, None, False), (settings.STRAGGLER_REPORT_DISABLE, "1", True),
    (settings.STRAGGLER_REPORT_DISABLE, "0", False), (settings.STRAGGLER_REPORT_DISABLE, "yes", False),
    (settings.STRAGGLER_REPORT_DISABLE, "2", False),
])
def test_the_step_report_settings_are_lenient(setting, text, value):
    environ = {} if text is None else {setting.ours: text}
    assert setting.read(environ) == value


def test_a_lenient_setting_is_no_refusal(monkeypatch):
    """mtrain run refuses a job whose runtime settings init() would refuse; a lenient one it starts."""
    from mtrain.launcher.cli.tuning import refused_variable
    lenient = {"MTRAIN_FLIGHT_RECORDER_SIZE": "abc", "MTRAIN_STRAGGLER_EVERY": "often",
               "MTRAIN_STEP_REPORT_SECONDS": "soon", "MTRAIN_STRAGGLER_REPORT_DISABLE": "maybe"}
    assert refused_variable(lenient) is None
    assert settings.FLIGHT_RECORDER_SIZE.refused(lenient) == (
        "MTRAIN_FLIGHT_RECORDER_SIZE='abc' is not a whole number; using 256 (set it to 0 to turn the flight "
        "recorder off)")
    assert refused_variable({"MTRAIN_CACHE_CAPACITY": "lots"}) == (
        "MTRAIN_CACHE_CAPACITY='lots' is not a whole number of op names >= 0 (0 turns the response cache off); "
        "set it to one or unset it")


def test_the_step_meter_follows_the_table(monkeypatch):
    from mtrain.ringreduce.observe import steps
    monkeypatch.setenv("MTRAIN_STRAGGLER_REPORT_DISABLE", "1")
    assert steps.job_meter() is None
    monkeypatch.setenv("MTRAIN_STRAGGLER_REPORT_DISABLE", "0")
    assert isinstance(steps.job_meter(), steps.StepMeter)


def test_the_configs_take_their_defaults_from_the_table():
    autotune = settings.AutotuneConfig()
    assert autotune == settings.AutotuneConfig.from_environment({})
    assert (autotune.warmup_samples, autotune.steps_per_sample, autotune.bayes_opt_max_samples,
            autotune.gaussian_process_noise) == (3, 10, 20, 0.8)  # Horovod's (parameter_manager.cc)
    assert settings.EngineConfig() == settings.EngineConfig.from_environment({})
