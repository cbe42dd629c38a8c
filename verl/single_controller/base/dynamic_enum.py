"""`DynamicEnum`: an enum-like class whose members can be added and removed at run time (veRL's `Dispatch`
is one, so that users can register their own dispatch modes)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["DynamicEnum"]


class _DynamicEnumMeta(type):
    """Iteration, `in` and `len` over the registered members of a `DynamicEnum` subclass."""

    def __iter__(cls) -> Iterator[Any]:
        return iter(cls._members.values())

    def __contains__(cls, item: Any) -> bool:
        return isinstance(item, cls) and cls._members.get(item.name) is item

    def __len__(cls) -> int:
        return len(cls._members)


class DynamicEnum(metaclass=_DynamicEnumMeta):
    """Base of an enum whose members (`Cls.NAME`, each with `.name` and `.value`) are added by `register` and
    removed by `remove`. Members compare by identity and pickle by name (unpickling looks the name up)."""

    _members: dict[str, DynamicEnum] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._members = {}

    def __init__(self, name: str, value: Any) -> None:
        self.name = name
        self.value = value

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {self.value!r}>"

    def __reduce__(self) -> tuple[Any, tuple[Any, str]]:
        return getattr, (type(self), self.name)

    @classmethod
    def register(cls, name: str, value: Any = None) -> DynamicEnum:
        """Add and return the member `name` (value defaults to the lower-cased name); a taken name is an error."""
        if not name.isidentifier() or name.startswith("_"):
            raise ValueError(f"{cls.__name__}.register: {name!r} is not a public identifier")
        if name in cls._members or hasattr(cls, name):
            raise ValueError(f"{cls.__name__}.register: {name!r} already exists")
        member = cls(name, name.lower() if value is None else value)
        cls._members[name] = member
        setattr(cls, name, member)
        return member

    @classmethod
    def remove(cls, name: str) -> None:
        """Remove the member `name`; an unknown name is an error."""
        if name not in cls._members:
            raise ValueError(f"{cls.__name__}.remove: no member {name!r}; members: {list(cls._members)}")
        del cls._members[name]
        delattr(cls, name)
