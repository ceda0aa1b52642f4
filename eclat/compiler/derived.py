"""Arrays a backend derives from a weight (its packed forms), shared while something holds them:
the candidates of one compile, its tuning builds, its schedule variants and the programs of one
model (a language model's prefill and decode) share them, and packing a large weight (a language
model's output head) costs seconds. They are found by the weight's content, so that two programs'
own copies of one weight (a transposed layout each made) share one packed form. The cache holds
them weakly: the forms a search tried and discarded (a panel width it did not choose) go with the
last executable that read them, rather than staying for the whole compile. A compile can ask which
forms a build asked for (`asked_for`) and which were held before it began (`compiling`,
`held_before`): a schedule that packs a weight anew where another program holds it packed already
costs memory (compiler.tune), and a one-row product reads such a copy as it is (backends.cpu)."""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np

_DERIVED: dict[tuple, tuple[type, list[weakref.ref]]] = {}
_DIGESTS: dict[tuple, str] = {}  # (the array a view views, the view) -> its content's digest
_ASKED: list[set[tuple]] = []  # the keys asked for inside each open `asked_for` block
_BEFORE: ContextVar[frozenset[tuple]] = ContextVar("eclat_held_before", default=frozenset())


def derived(data: np.ndarray, key: Hashable, make: Callable[[], Any]) -> Any:
    """make() (an array, or a list or tuple of arrays), computed once per (data's values, key)
    while its result is held elsewhere."""
    full = _full_key(data, key)
    for keys in _ASKED:
        keys.add(full)
    held = _DERIVED.get(full)
    value = _alive(held)
    if value is _GONE:
        value = make()
        parts = [] if value is None else [value] if isinstance(value, np.ndarray) else list(value)
        entry = _DERIVED[full] = (type(value), [weakref.ref(a) for a in parts])
        if parts:  # forgotten with the result
            weakref.finalize(parts[0], lambda: _DERIVED.get(full) is entry and _DERIVED.pop(full))
    return value


@contextmanager
def asked_for() -> Iterator[set[tuple]]:
    """The keys of the derived forms asked for inside the block (made or found)."""
    keys: set[tuple] = set()
    _ASKED.append(keys)
    try:
        yield keys
    finally:
        _ASKED.remove(keys)


@contextmanager
def compiling() -> Iterator[None]:
    """Within the block (a compile), `held_before` names the forms held as it began."""
    token = _BEFORE.set(held())
    try:
        yield
    finally:
        _BEFORE.reset(token)


def held_before() -> frozenset[tuple]:
    """The keys of the forms held when the enclosing `compiling` block began (another program's:
    a language model's prefill for its decode); none outside one."""
    return _BEFORE.get()


def was_held(data: np.ndarray, key: Hashable) -> bool:
    """Whether derived(data, key, ...)'s form was held when the enclosing `compiling` began (and is)."""
    before = _BEFORE.get()
    if not before:  # nothing held (most compiles): no digest of data to take
        return False
    full = _full_key(data, key)
    return full in before and _alive(_DERIVED.get(full)) is not _GONE


def _full_key(data: np.ndarray, key: Hashable) -> tuple:
    return content(data), data.shape, data.dtype.str, key


def held() -> frozenset[tuple]:
    """The keys of the derived forms something holds now."""
    return frozenset(k for k, entry in list(_DERIVED.items()) if _alive(entry) is not _GONE)


def nbytes(key: tuple) -> int:
    """The bytes of the form under key while it is held, else 0."""
    value = _alive(_DERIVED.get(key))
    parts = [] if value is _GONE or value is None else [value] if isinstance(value, np.ndarray) else value
    return sum(a.nbytes for a in parts)


def content(data: np.ndarray) -> str:
    """A digest of data's values (in C order), computed once per view while the viewed array lives."""
    base = viewed(data)  # a view made afresh per candidate: key on what it views
    key = (id(base), data.__array_interface__["data"][0], data.shape, data.strides, data.dtype.str)
    if key not in _DIGESTS:
        _DIGESTS[key] = hashlib.blake2b(memoryview(np.ascontiguousarray(data)).cast("B"),
                                        digest_size=16).hexdigest()
        weakref.finalize(base, _DIGESTS.pop, key, None)
    return _DIGESTS[key]


def viewed(data: np.ndarray) -> np.ndarray:
    """The array data is a view of, through any chain of views (data itself when it owns its data)."""
    while isinstance(data.base, np.ndarray):
        data = data.base
    return data


_GONE = object()


def _alive(held: tuple[type, list[weakref.ref]] | None) -> Any:
    """The remembered result (the arrays themselves, as make returned them: a caller keeps those, not
    views of them), or _GONE when there is none or one of its arrays has been freed."""
    if held is None:
        return _GONE
    kind, refs = held
    parts = [r() for r in refs]
    if any(a is None for a in parts):
        return _GONE
    return None if kind is type(None) else parts[0] if kind is np.ndarray else kind(parts)


__all__ = ["asked_for", "compiling", "content", "derived", "held", "held_before", "nbytes", "was_held"]
