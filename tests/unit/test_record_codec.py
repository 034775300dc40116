"""The records' one codec refuses, when a record class is made, the shapes it cannot carry:
a tuple field of mixed types, and a record that extends one with fields (it would drop them)."""
import pytest

from mtrain.common.records.base import Record


def test_a_tuple_field_of_mixed_types_is_refused():
    with pytest.raises(TypeError, match=r"tuple\[T, \.\.\.\]"):
        class Pair(Record):  # noqa: F841
            both: tuple[int, str]


def test_a_record_extending_one_with_fields_is_refused():
    class Base(Record):
        a: int

    with pytest.raises(TypeError, match="cannot extend Base"):
        class More(Base):  # noqa: F841
            b: int


def test_a_homogeneous_tuple_round_trips():
    class Many(Record):
        items: tuple[int, ...]

    assert Many.decode(Many((3, 1, 2)).encode()) == Many((3, 1, 2))
