"""`fp4rl.ops` reaches the kernels through the package it imports on CUDA tensors only
(``kernels = _kernels(x)``), so the CPU suite never runs those lookups: a kernel module's name
moved elsewhere breaks only the GPU. Every ``kernels.<module>.<name>`` that a module of
`fp4rl.ops` spells out, directly or through a local alias of the module, must name something
that module defines."""

import ast
import importlib
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

import fp4rl.ops  # noqa: E402


def kernel_lookups(source: str) -> list[tuple[int, str, str]]:
    """``(line, module, name)`` for each ``kernels.<module>.<name>`` in ``source``, and each
    ``alias.<name>`` after ``alias = kernels.<module>``."""
    tree = ast.parse(source)

    def module_of(node) -> str | None:
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "kernels"
        ):
            return node.attr
        return None

    aliases = {
        target.id: module
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and (module := module_of(node.value)) is not None
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        module = module_of(node.value)
        if module is None and isinstance(node.value, ast.Name):
            module = aliases.get(node.value.id)
        if module is not None:
            found.append((node.lineno, module, node.attr))
    return found


def test_ops_names_only_what_the_kernel_modules_define():
    lookups = [
        (path.name, *lookup)
        for path in sorted(Path(fp4rl.ops.__file__).parent.glob("*.py"))
        for lookup in kernel_lookups(path.read_text())
    ]
    assert len(lookups) >= 15  # the walk finds them (fp4rl.ops spells out about twenty)
    missing = [
        f"{file}:{line}: kernels.{module}.{name}"
        for file, line, module, name in lookups
        if not hasattr(importlib.import_module(f"fp4rl.kernels.{module}"), name)
    ]
    assert not missing, missing


def test_the_walk_sees_aliases_and_moved_names():
    """The lookup that broke the GPU engine once (a module's tiles moved elsewhere, read
    through an alias) is found, and named as missing."""
    source = "attention = kernels.paged_attention\nx = attention.CONFIGS\n"
    assert kernel_lookups(source) == [(2, "paged_attention", "CONFIGS")]
    module = importlib.import_module("fp4rl.kernels.paged_attention")
    assert not hasattr(module, "CONFIGS")
