"""The part of the per-call check outside the graphed module: the module globals the
forward's code reads and the attributes it reads of plain objects its modules hold (a
config), learnt in warmup (``reads``). A graph bakes in the host decisions they drove, so
a change is refused at the next call, in graphs and eager replay alike."""
from __future__ import annotations

import operator
from typing import Optional

from .reads import ForwardReads, kept, object_attribute, plain_value

__all__ = ["OutsideReads"]

_getitem = operator.getitem


class OutsideReads:
    """The watched values: one tuple compared at each call."""

    __slots__ = ("_tables", "_keys", "_whats", "_expected")

    def __init__(self, entries: list[tuple[dict, str, str]]):
        self._tables = tuple(table for table, _, _ in entries)
        self._keys = tuple(key for _, key, _ in entries)
        self._whats = tuple(what for _, _, what in entries)
        self._expected = tuple(kept(table[key]) for table, key, _ in entries)

    @staticmethod
    def of(reads: Optional[ForwardReads]) -> Optional["OutsideReads"]:
        """What ``reads`` found outside the modules (None where nothing: no per-call work),
        less what the forward itself changed (its own per-call state)."""
        if reads is None:
            return None
        entries = []
        for key, (table, name, what) in sorted(reads.globals.items(), key=lambda item: item[1][2]):
            if key not in reads.changed and name in table and plain_value(table[name]):
                entries.append((table, name, what))
        for obj, _ in reads.objects.values():
            table = vars(obj)
            for name in sorted(reads.attributes.get(id(obj), ())):
                if (id(table), name) not in reads.changed and name in table and plain_value(table[name]):
                    entries.append((table, name, object_attribute(obj, name)))
        return OutsideReads(entries) if entries else None

    def matches(self) -> bool:
        try:
            return tuple(map(_getitem, self._tables, self._keys)) == self._expected
        except KeyError:  # deleted
            return False

    def changes(self) -> list[str]:
        found = []
        for table, key, what, then in zip(self._tables, self._keys, self._whats, self._expected):
            if key not in table:
                found.append(f"{what} was deleted")
            elif table[key] != then:
                found.append(f"{what} is {table[key]!r}, but was {then!r} at capture (the forward's Python "
                             "code read it, and the graph replays the path it took then)")
        return found
