"""mtrain.spark's one-line answers to what it cannot use: no pyspark, no Java 17, no Spark session.
(A real cluster, and a cluster that cannot be reached: tests/cluster/test_spark.py.)"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mtrain.spark.runner import SparkRunError, java_problem, rank_plan, run, settle_start_timeout
from mtrain.spark.task import ServiceFacts


def fake_java(folder: Path, banner: str) -> None:
    java = folder / "java"
    java.write_text(f"#!/bin/sh\necho '{banner}' >&2\n")
    java.chmod(0o755)


def test_without_pyspark_the_line_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pyspark", None)  # what `import pyspark` sees when it is not installed
    with pytest.raises(ImportError) as error:
        run(print)
    assert str(error.value) == "mtrain.spark needs pyspark: pip install 'mtrain[spark]'"


def test_without_java_the_line_names_java_17(monkeypatch, tmp_path) -> None:
    pytest.importorskip("pyspark")
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no java here
    with pytest.raises(SparkRunError) as error:
        run(print)  # (no Spark session either: Java is the reason one could not start)
    line = str(error.value)
    assert "\n" not in line and "Java 17 or newer" in line and "no `java` on PATH" in line


@pytest.mark.parametrize("banner, major", [('openjdk version "11.0.22" 2024-01-16', 11),
                                           ('java version "1.8.0_402"', 8)])
def test_an_old_java_is_named_with_its_version(tmp_path, banner, major) -> None:
    fake_java(tmp_path, banner)
    line = java_problem({"PATH": str(tmp_path)})
    assert line is not None and f"is Java {major}; pyspark needs Java 17 or newer" in line


def test_java_17_and_later_pass(tmp_path) -> None:
    fake_java(tmp_path, 'openjdk version "21.0.3" 2024-04-16')
    assert java_problem({"PATH": str(tmp_path)}) is None
    assert java_problem({"JAVA_HOME": str(tmp_path / "none")}).startswith(  # type: ignore[union-attr]
        "mtrain.spark: pyspark needs Java 17 or newer, and JAVA_HOME=")


def test_without_a_spark_session_the_line_says_to_start_one(monkeypatch) -> None:
    pytest.importorskip("pyspark")
    if java_problem():
        pytest.skip(f"this machine has no Java 17: {java_problem()}")
    with pytest.raises(SparkRunError) as error:
        run(print)
    assert str(error.value).startswith("mtrain.spark.run: no active Spark session: start one first")


def test_ranks_go_host_by_host_in_the_order_of_their_first_task() -> None:
    facts = [ServiceFacts("b", "10.0.0.2", 1), ServiceFacts("a", "10.0.0.1", 2), ServiceFacts("b", "10.0.0.2", 3)]
    services, slots = rank_plan(facts)
    assert list(slots.items()) == [("b", 2), ("a", 1)]
    assert services == {"b": ("10.0.0.2", 1), "a": ("10.0.0.1", 2)}  # each host's first task serves it


def test_start_timeout_comes_from_the_argument_then_horovods_variable(monkeypatch) -> None:
    monkeypatch.delenv("HOROVOD_SPARK_START_TIMEOUT", raising=False)
    assert settle_start_timeout(None) == 600
    monkeypatch.setenv("HOROVOD_SPARK_START_TIMEOUT", "42")
    assert (settle_start_timeout(None), settle_start_timeout(5)) == (42, 5)
    monkeypatch.setenv("HOROVOD_SPARK_START_TIMEOUT", "soon")
    with pytest.raises(SparkRunError, match="HOROVOD_SPARK_START_TIMEOUT='soon' is not a number"):
        settle_start_timeout(None)
