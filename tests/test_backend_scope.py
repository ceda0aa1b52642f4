"""eclat.backends.scope.Scope: the scoped expression memo shared by the GPU and CPU emitters."""

from __future__ import annotations

import pytest

from eclat.backends.scope import Scope


def test_lookups_search_innermost_first_and_pop_forgets() -> None:
    s: Scope[str] = Scope()
    s.bind("i0", "i0")
    s.remember("x", "v1")
    assert s.depth == 0 and s.bound() == {"i0"} and s.cached("x") == "v1"
    s.push()
    s.bind("r1", "r1")
    s.remember("x", "v2")  # shadows the outer value
    s.remember("y", "v3")
    assert s.depth == 1
    assert s.bound() == {"i0", "r1"}
    assert s.cached("x") == "v2" and s.cached("y") == "v3"
    assert s.var("i0") == "i0" and s.var("r1") == "r1"
    s.pop()
    assert s.bound() == {"i0"}
    assert s.cached("x") == "v1" and s.cached("y") is None
    with pytest.raises(KeyError):
        s.var("r1")


def test_remember_returns_its_value_and_keys_are_any_hashable() -> None:
    s: Scope[int] = Scope()
    key = ("add", 1, 2)
    assert s.remember(key, 7) == 7
    assert s.cached(("add", 1, 2)) == 7
    assert s.cached(("add", 2, 1)) is None
    s.remember("zero", 0)  # a falsy value is still a hit
    assert s.cached("zero") == 0


def test_nested_pops_on_exit_and_on_error() -> None:
    s: Scope[str] = Scope()
    with s.nested():
        s.bind("i1", "a")
        assert s.var("i1") == "a"
        with s.nested():
            s.bind("i1", "b")  # rebinding in an inner block shadows
            assert s.var("i1") == "b" and s.depth == 2
        assert s.var("i1") == "a"
    assert s.depth == 0 and s.bound() == set()
    with pytest.raises(RuntimeError), s.nested():
        raise RuntimeError
    assert s.depth == 0


def test_the_outermost_layer_cannot_be_popped() -> None:
    s: Scope[str] = Scope()
    with pytest.raises(IndexError):
        s.pop()
