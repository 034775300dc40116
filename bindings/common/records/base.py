"""The base of every record that crosses a process boundary: frozen, compared by value, and
encoded to JSON by one codec driven by its fields' type hints.

A record is a plain class whose annotated class attributes are its fields, in order (a value in
the class body is that field's default, and must be immutable).  ``Record`` gives it what
``dataclass(frozen=True)`` would, without importing dataclasses (and inspect with it), ~10 ms of
CPU at the start of every rank wrapper and remote guard, on a launch's critical path.

The codec knows the types the records use: ``int``, ``float``, ``str``, ``bool``, an ``Enum``
(its value), another record (a JSON object, or what that record's ``to_json`` gives), and
``tuple[T, ...]`` of any of these (a JSON list).  Record modules do not use
``from __future__ import annotations``: the codec reads the hints as the objects they are.
"""
import enum
import json
import typing

# Errors that mean "not one of ours" when reading a record someone wrote.
DECODE_ERRORS = (ValueError, KeyError, TypeError, IndexError, AttributeError)
R = typing.TypeVar("R", bound="Record")
Codec = typing.Tuple[typing.Callable[[typing.Any], typing.Any], typing.Callable[[typing.Any], typing.Any]]


def _codec(hint: typing.Any) -> Codec:
    """(encode, decode) for one field's type hint: value -> JSON-able, JSON value -> value."""
    if getattr(hint, "__origin__", None) is tuple:
        if hint.__args__[1:] != (Ellipsis,):  # type: ignore[attr-defined]
            raise TypeError(f"a record's tuple field is tuple[T, ...], not {hint!r}")
        item_encode, item_decode = _codec(hint.__args__[0])  # type: ignore[attr-defined]
        return (lambda value: [item_encode(item) for item in value],
                lambda data: tuple(item_decode(item) for item in data))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return (lambda value: value.value), hint
    if isinstance(hint, type) and issubclass(hint, Record):
        return (lambda value: value.to_json()), hint.from_json
    if hint in (int, float, str, bool):
        return (lambda value: value), hint
    raise TypeError(f"a record field cannot be of type {hint!r}")


class Record:
    """A frozen record of its annotated fields: ``__init__`` by position or keyword, ``==`` and
    ``hash`` over the fields, ``repr``, ``_asdict()``, ``replace(**changes)``, and the JSON codec
    (``to_json``/``from_json``, ``encode``/``decode``); assigning to a field raises AttributeError."""

    _fields: "tuple[str, ...]" = ()
    _defaults: "dict[str, object]" = {}
    _codecs: "dict[str, Codec]" = {}
    # The JSON text's separators: None is json's default; StepReport sends compact lines.
    json_separators: "tuple[str, str] | None" = None
    # A record sent by the many (StepSample) can travel as a row: its field values in order,
    # floats rounded to json_float_digits (None: as they are).
    json_row = False
    json_float_digits: "int | None" = None
    # Fields a reader takes as their defaults when absent (fields added after others wrote the
    # record); every other field must be there, or the text is not one of these records.
    json_optional: "tuple[str, ...]" = ()

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        names = tuple(cls.__dict__.get("__annotations__", {}))
        inherited = [base.__name__ for base in cls.__mro__[1:] if issubclass(base, Record) and base._fields]
        if inherited:  # their fields would be lost: records are flat
            raise TypeError(f"record {cls.__name__} cannot extend {inherited[0]}, which has fields")
        cls._fields = names
        cls._defaults = {name: cls.__dict__[name] for name in names if name in cls.__dict__}
        cls._codecs = {name: _codec(cls.__dict__["__annotations__"][name]) for name in names}

    def __init__(self, *args: object, **kwargs: object) -> None:
        cls, names = type(self), self._fields
        # Every field by position (how a step's sample is made, once per step): nothing to check.
        # The fields are written once, here; ``__setattr__`` refuses any later write.
        if not kwargs and len(args) == len(names):
            self.__dict__.update(zip(names, args))
            return
        if len(args) > len(names):
            raise TypeError(f"{cls.__name__}() takes {len(names)} fields, {len(args)} given")
        values = dict(zip(names, args))
        for name, value in kwargs.items():
            if name not in names or name in values:
                raise TypeError(f"{cls.__name__}() got an unexpected or repeated field {name!r}")
            values[name] = value
        for name in names:
            if name not in values:
                if name not in self._defaults:
                    raise TypeError(f"{cls.__name__}() is missing field {name!r}")
                values[name] = self._defaults[name]
        self.__dict__.update((name, values[name]) for name in names)

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in self._fields)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._fields)
        return f"{type(self).__name__}({shown})"

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"cannot assign to field {name!r} of a frozen {type(self).__name__}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r} of a frozen {type(self).__name__}")

    def _asdict(self) -> dict:
        return {name: getattr(self, name) for name in self._fields}

    def replace(self: R, **changes: object) -> R:
        return type(self)(**{**self._asdict(), **changes})

    # -- the JSON codec -------------------------------------------------------------------------

    def to_json(self) -> object:
        """The record as JSON-able values: an object keyed by its field names (a list, for a row)."""
        values = {name: self._codecs[name][0](getattr(self, name)) for name in self._fields}
        if self.json_float_digits is not None:
            values = {name: round(value, self.json_float_digits) if isinstance(value, float) else value
                      for name, value in values.items()}
        return list(values.values()) if self.json_row else values

    @classmethod
    def from_json(cls: "type[R]", data: typing.Any) -> R:
        """The record from ``to_json``'s form (a field of ``json_optional`` may be absent).  Raises
        one of DECODE_ERRORS when ``data`` is not such a record."""
        if cls.json_row:
            data = dict(zip(cls._fields, data))
        if not isinstance(data, dict):
            raise TypeError(f"{cls.__name__}: a JSON object expected, not {type(data).__name__}")
        values = {}
        for name in cls._fields:
            if name in data:
                values[name] = cls._codecs[name][1](data[name])
            elif name not in cls.json_optional:
                raise KeyError(name)
        return cls(**values)

    def encode(self) -> str:
        """The record as one line of JSON text."""
        return json.dumps(self.to_json(), separators=self.json_separators)

    @classmethod
    def decode(cls: "type[R]", text: "str | bytes") -> "R | None":
        """The record in ``text`` (``encode``'s form; a marker line's payload), or None for anything else."""
        try:
            return cls.from_json(json.loads(text))
        except DECODE_ERRORS:
            return None
