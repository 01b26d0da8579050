"""The layering of docs/design.md, enforced: import-linter's contracts (pyproject.toml) hold, they
name every core package and every package of cadence.torch, and importing the core leaves torch
unimported."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import cadence

ROOT = Path(__file__).resolve().parents[2]
ON_TOP = {"cadence.torch", "cadence.cli", "cadence.__main__"}


def contracts() -> dict[str, dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["name"]: c for c in config["contracts"]}


def test_import_contracts_are_kept() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint_imports)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in contracts():
        assert f"{name} KEPT" in proc.stdout


def test_the_core_contract_lists_every_module_but_those_on_top() -> None:
    """A new module or package is in the core unless it is declared on top: it cannot escape the check."""
    modules = {f"cadence.{m.name}" for m in pkgutil.iter_modules(cadence.__path__)}
    core = set(contracts()["core: no torch"]["source_modules"])
    assert core == modules - ON_TOP
    assert set(contracts()["torch: below the CLI"]["forbidden_modules"]) == ON_TOP - {"cadence.torch"}


def test_the_torch_layers_name_every_torch_package() -> None:
    """A new package under cadence.torch must take its place in the layers (a module there would
    sit beside them unchecked: cadence.torch holds packages only)."""
    import cadence.torch

    found = {m.name: m.ispkg for m in pkgutil.iter_modules(cadence.torch.__path__)}
    layers = {name.strip() for layer in contracts()["torch: its packages one way"]["layers"] for name in layer.split("|")}
    assert all(found.values()), f"modules directly in cadence.torch: {[n for n, pkg in found.items() if not pkg]}"
    assert set(found) == layers


def test_importing_the_core_does_not_import_torch() -> None:
    code = ("import sys, cadence, cadence.loop.controller, cadence.sidecar.evaluator, cadence.actions, cadence.config, "
            "cadence.cluster.roles, cadence.checkpoint, cadence.loop.hooks, cadence.extensions, cadence.loop.schedule, "
            "cadence.trackers.base; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_a_run_imports_torch_distributed_checkpoint_only_for_a_sharded_checkpoint() -> None:
    """DCP (and the sympy it pulls in: about 1.4 s of CPU per process) and DTensor are not imported
    by the modules every run imports (each process of a DDP job, the sidecar, ``cadence export``)."""
    code = ("import sys, cadence.cli.main, cadence.torch.experiments, cadence.torch.experiments.experiment, "
            "cadence.torch.loop.trainer, cadence.torch.components.ema, cadence.torch.loop.evaluator, "
            "cadence.torch.checkpoint_io.shard_writes; print('torch.distributed.checkpoint' in sys.modules, "
            "'sympy' in sys.modules, 'torch.distributed.tensor' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.stdout.split() == ["False", "False", "False"]
