"""Imports flow one way (docs/design.md): each package of fp4rl imports only those below it.

Read from the source with `ast`, so a lazy import inside a function counts as much as one at
the top of a module. A new package must be given its place in ``ALLOWED`` before it passes.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "fp4rl"

# package (first component under fp4rl/, a module's stem for top-level files) -> what it may import
ALLOWED = {
    "checks": set(),
    "fp4": {"fp4"},
    "kernels": {"fp4", "kernels"},
    "ops": {"fp4", "kernels", "ops"},
    "row_records": set(),  # a completion's records as rows of its call's bytes (torch only)
    "records": {"fp4", "row_records"},
    "model": {"fp4", "ops", "records", "model", "checks"},
    "rollout": {"fp4", "ops", "records", "model", "rollout", "checks"},
    "train": {"fp4", "ops", "records", "model", "train", "checks"},
    "refit": {"fp4", "ops", "records", "model", "rollout", "refit"},
    # several ranks: FSDP2 over the trainer, its optimizer, the refit stream gathered per layer
    "distributed": {"train", "refit"},
    "tasks": {"tasks", "checks"},
    "config": {"fp4", "ops", "records", "model", "rollout", "train", "tasks", "config", "checks"},
    "progress": set(),
    "metrics_log": set(),  # metrics.jsonl read back, TensorBoard; tensorboard imported lazily
    "report": {"metrics_log"},  # a run's plots and report.md; matplotlib imported lazily
    # a run's saved state: the HF writer, the optimizer's state, the run's config
    "checkpoints": {"model", "train", "config", "distributed"},
    # held-out accuracy and the engine it is measured on (the rollout's, or a BF16 twin)
    "evaluation": {"rollout", "refit", "tasks", "config", "distributed"},
    # a run directory over the run's life: start or resume, metrics.jsonl, checkpoints saved
    "run_dir": {"tasks", "config", "metrics_log", "checkpoints", "distributed"},
    "loop": {
        "fp4",
        "ops",
        "records",
        "model",
        "rollout",
        "train",
        "refit",
        "tasks",
        "config",
        "progress",
        "metrics_log",
        "distributed",
        "evaluation",
        "run_dir",
    },  # fmt: skip
    "demo": {"fp4", "ops", "records", "model", "train", "tasks", "config", "loop"},
    # a study directory's layout and its finished runs aggregated: curves, tables, results.md
    "study_results": {"metrics_log", "report"},
    # the rollout variants compared: the demo's base policy, the loop's runs, their metrics
    "study": {
        "model",
        "train",
        "config",
        "metrics_log",
        "checkpoints",
        "loop",
        "demo",
        "inference",
        "study_results",
    },  # fmt: skip
    # a run's checkpoint to a servable one: the precision plan, the engine's packing, the writer
    "export": {"fp4", "ops", "model", "config", "checks", "checkpoints"},
    # generation and evaluation outside training: the loop's engine set-up and metric
    "inference": {"model", "rollout", "tasks", "config", "progress", "loop", "export"},
    "cli": {"commands"},
    "__main__": {"cli"},
}

# Every layer's user, below only the command line; the commands import their work lazily, inside
# ``run``.
ALLOWED["commands"] = set(ALLOWED) - {"cli", "__main__"} | {"commands"}


def package_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def fp4rl_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "fp4rl" and len(parts) > 1:
                found.add(parts[1])
    return found


MODULES = sorted(p for p in ROOT.rglob("*.py") if p.name != "__init__.py" or p.parent != ROOT)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_imports_only_the_packages_below_it(path):
    package = package_of(path)
    assert package in ALLOWED, f"{package} has no place in the import order; add it to ALLOWED"
    imported = fp4rl_imports(path)
    assert imported <= ALLOWED[package], (
        f"{path.relative_to(ROOT)} ({package}) imports {sorted(imported - ALLOWED[package])}"
    )


def test_test_modules_have_unique_basenames():
    """Test folders have no ``__init__.py``, so pytest refuses two test modules of one name."""
    names = [p.name for p in (ROOT.parent / "tests").rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
