"""The dependency direction holds: pyproject.toml's import-linter contracts, and that they bite.

A contract that can never fail (a module renamed under it, a source list that misses
the module that imports) is worse than none, so each contract is also run on a copy of
the package with one forbidden import added and must then fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: One forbidden import per contract id: (module to write or extend, the import).
BREAKS = {
    "layers": ("elasticrun/store/throwaway.py", "from elasticrun.rendezvous import records"),
    "launcher-on-top": ("elasticrun/worker/throwaway.py", "import elasticrun.launcher.cli"),
    "api-on-top": ("elasticrun/launcher/throwaway.py", "import elasticrun.api"),
    "store-interface": ("elasticrun/rendezvous/throwaway.py", "from elasticrun.store.server.memory import MemoryStore"),
    "client-not-server": ("elasticrun/store/client/c10d.py", "from elasticrun.store.server.callers import Caller"),
    "no-cycles": ("elasticrun/store/server/limits.py", "from elasticrun.store.server import kv_service"),
    "worker-client-only": ("elasticrun/worker/throwaway.py", "from elasticrun.store.etcd.backend import EtcdStore"),
}


def lint_imports(root: Path, *contracts: str) -> subprocess.CompletedProcess[str]:
    """Run import-linter on the package under `root` (only `contracts`, when given)."""
    code = (
        "import sys\n"
        "from importlinter.cli import lint_imports\n"
        "sys.exit(lint_imports(limit_to_contracts=tuple(sys.argv[1:]), no_cache=True, no_logo=True))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *contracts], cwd=root, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(root), "COLUMNS": "200"},  # no wrapped lines to match
    )


def contract_ids() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return [contract["id"] for contract in config["tool"]["importlinter"]["contracts"]]


def test_the_package_keeps_every_import_contract() -> None:
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(contract_ids())} kept, 0 broken." in result.stdout


def test_every_contract_has_a_forbidden_import_to_check_it() -> None:
    assert sorted(BREAKS) == sorted(contract_ids())


@pytest.mark.parametrize("contract", sorted(BREAKS))
def test_a_forbidden_import_breaks_its_contract(contract: str, tmp_path: Path) -> None:
    shutil.copytree(REPO / "elasticrun", tmp_path / "elasticrun", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    module, line = BREAKS[contract]
    with (tmp_path / module).open("a") as f:
        f.write(f"\n{line}  # noqa: F401\n")
    result = lint_imports(tmp_path, contract)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Contracts: 0 kept, 1 broken." in result.stdout, result.stdout
    dotted = module.removesuffix(".py").replace("/", ".")
    package, _, name = dotted.rpartition(".")  # a cycle is named in its package: ".limits -> ..."
    assert dotted in result.stdout or (package in result.stdout and f".{name} ->" in result.stdout), result.stdout
