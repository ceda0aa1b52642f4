"""The structure the architecture document describes, checked: layers import downwards, nothing
under compiler/ or autotune/ names a specific backend, there are no import circles, and a target
added as nothing but its own folder runs through compile(), tuning, artifacts and the CLI."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import numpy as np
import pytest
import torch

import eclat
from eclat.backends import TARGETS, get_target, register, target_names, unregister
from tests.gpu_cases import opencl_or_skip

PACKAGE = Path(eclat.__file__).parent


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node, except inside `if TYPE_CHECKING:` (imports for type hints only)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        yield node
        yield from _runtime_nodes(node)


def _imports() -> dict[str, set[str]]:
    """module -> the eclat modules it imports, at module level or inside functions (a submodule
    named by `from package import name` counts as that submodule)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                subs = {f"{base}.{a.name}" for a in node.names} & modules.keys()
                found |= subs or {base}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_compiler_and_autotune_name_no_specific_backend():
    below = ("eclat.compiler", "eclat.autotune")
    offenders = {(m, dep) for m, deps in _imports().items() if m.startswith(below)
                 for dep in deps if dep.startswith("eclat.backends.")}
    assert not offenders, sorted(offenders)


def test_there_are_no_import_circles():
    try:
        tuple(graphlib.TopologicalSorter(_imports()).static_order())
    except graphlib.CycleError as e:
        pytest.fail(f"import circle: {' -> '.join(e.args[1])}")


def test_every_registered_target_is_a_whole_target():
    for name in target_names():
        target = get_target(name)
        assert target.name == name and target.source_member, name
        assert all(type(rs).__name__ == "RuleSet" for rs in target.rules()), name


class _Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(torch.relu(self.fc(x)) * 2.0, dim=-1)


@pytest.fixture
def fake_target():
    opencl_or_skip()
    register("fakecl", "tests.fake_target:TARGET")
    yield get_target("fakecl")
    unregister("fakecl")


def test_a_target_in_its_own_folder_runs_through_compile(fake_target, tmp_path, capsys):
    from eclat.cli import main
    from eclat.rewrites.registry import all_rulesets

    torch.manual_seed(0)
    model, x = _Small().eval(), torch.randn(4, 16)
    compiled = eclat.compile(model, (x,), target="fakecl", autotune="fast", cache_dir=tmp_path, quiet=True)
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(compiled(x), want, rtol=1e-4, atol=1e-5)
    report = compiled.report()
    assert report["target"] == "fakecl" and report["device"]["peak_gflops"]  # its probe measured it
    assert "FAKE_GLOBAL" in fake_target.render(compiled.executable.program)  # its dialect rendered it
    assert report["tuning_cache"]["misses"] >= 1  # its schedules were searched
    path = tmp_path / "m.eclat"
    compiled.save(str(path))
    loaded = eclat.load(str(path))
    np.testing.assert_allclose(loaded(x.numpy()), want.numpy(), rtol=1e-4, atol=1e-5)
    assert any(rs in all_rulesets() for rs in fake_target.rules())
    assert main(["inspect", str(path)]) == 0 and "fakecl" in capsys.readouterr().out
    assert "fakecl" in TARGETS


def test_an_unknown_target_is_named():
    with pytest.raises(eclat.EclatError, match="no backend for target 'fakecl'"):
        eclat.compile(_Small(), (torch.randn(4, 16),), target="fakecl")
