"""The project's layers, drawn as imports: the schedule core imports nothing heavy, the runtime
never imports the Megatron adapter, the training layer sits between the adapter and the
commands, and entry points never import each other. Read from the
source (every ``import``, at module level or inside functions), so a lazy import counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_pp_ext"


def imports_of(path: Path) -> set[str]:
    """Absolute dotted names this module imports (relative imports resolved)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def modules(subpackage: str) -> list[Path]:
    return sorted((PACKAGE / subpackage).rglob("*.py"))


def is_under(name: str, tops: tuple[str, ...]) -> bool:
    return any(name == top or name.startswith(top + ".") for top in tops)


def offenders(subpackage: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    """Modules of ``subpackage`` that import anything under ``forbidden``, with what."""
    found = {}
    for path in modules(subpackage):
        bad = sorted(name for name in imports_of(path) if is_under(name, forbidden))
        if bad:
            found[str(path.relative_to(PACKAGE))] = bad
    return found


def test_imports_of_resolves_relative_imports() -> None:
    names = imports_of(PACKAGE / "megatron" / "calibration.py")
    assert "megatron_pp_ext.runtime.memory" in names
    assert "megatron_pp_ext.megatron.model" in names


def test_schedule_core_is_pure_python() -> None:
    forbidden = ("torch", "megatron", "yaml", "numpy", "megatron_pp_ext.runtime", "megatron_pp_ext.megatron")
    assert not offenders("schedule", forbidden)


@pytest.mark.parametrize("layer", ["runtime", "attention"])
def test_runtime_never_imports_the_adapter_or_entry_points(layer: str) -> None:
    forbidden = ("megatron_pp_ext.megatron", "megatron_pp_ext.commands", "megatron_pp_ext.bench")
    assert not offenders(layer, forbidden)


def test_adapter_never_imports_entry_points() -> None:
    assert not offenders(
        "megatron", ("megatron_pp_ext.commands", "megatron_pp_ext.bench", "megatron_pp_ext.cli")
    )


@pytest.mark.parametrize("layer", ["schedule", "runtime", "attention", "megatron"])
def test_nothing_below_the_training_layer_imports_it(layer: str) -> None:
    """The training layer (``training/``) may import the adapter, the runtime and the schedule;
    none of them imports it back."""
    assert not offenders(layer, ("megatron_pp_ext.training",))


def test_training_layer_never_imports_entry_points() -> None:
    """The commands import the training layer (the train command launches its job), never the
    reverse: the job's errors live in the neutral ``megatron_pp_ext.errors``."""
    assert not offenders(
        "training", ("megatron_pp_ext.commands", "megatron_pp_ext.bench", "megatron_pp_ext.cli")
    )
    train_command = imports_of(PACKAGE / "commands" / "train.py")
    assert any(is_under(name, ("megatron_pp_ext.training",)) for name in train_command)


def test_entry_points_never_import_each_other() -> None:
    assert not offenders("bench", ("megatron_pp_ext.commands",))
    for path in modules("commands"):
        other_commands = {
            name
            for name in imports_of(path)
            if name.startswith("megatron_pp_ext.commands.")
            and not name.startswith("megatron_pp_ext.commands.errors")
            and name.split(".")[2] != path.stem
        }
        assert not other_commands, f"{path.name} imports {sorted(other_commands)}"
