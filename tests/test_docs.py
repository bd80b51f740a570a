"""The documentation stays in step with the code.

- docs/cli.md documents every flag that `--help` of the launcher and of each subcommand
  lists, in that command's section, with the parser's default; and it names no flag
  (anywhere) that does not exist. The `--rdzv-conf` key table matches the known keys.
- docs/troubleshooting.md quotes every error message a user can see: the fixed text of
  every error raised in elasticrun/ (found in the source), save a few internal ones.
- Every relative link between the docs (and from README.md) points at a file that exists
  in this repository: a clone has nothing beside it to link to.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

import elasticrun.errors as errors
from elasticrun.launcher.cli import launch_parser, subcommand_parser
from elasticrun.launcher.config import KEEP_ALIVE_ATTEMPTS, RDZV_CONF_ALIASES, RDZV_CONF_KEYS, RDZV_CONF_TORCHRUN_ONLY

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FLAG = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")


@pytest.fixture(autouse=True)
def _no_pet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """PET_* variables change the launcher's defaults; compare with the plain ones."""
    import os

    for name in [n for n in os.environ if n.startswith("PET_")]:
        monkeypatch.delenv(name)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """cli.md section title -> the parser whose --help that section documents."""
    subs = _subparsers(subcommand_parser())
    parsers = {"Launcher": launch_parser()}
    for name in ("status", "list", "logs", "join", "drain", "stop"):
        parsers[f"`elasticrun {name}`"] = subs[name]
    for name in ("serve", "credential", "etcd-roles"):
        parsers[f"`elasticrun store {name}`"] = _subparsers(subs["store"])[name]
    return parsers


def listed_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """What --help lists: every option string, torchrun's underscore twins included."""
    return {s: a for a in parser._actions for s in a.option_strings}


def sections(text: str) -> dict[str, str]:
    """`## title` -> its text (up to the next `## `)."""
    parts = re.split(r"^## ", text, flags=re.M)
    return {part.split("\n", 1)[0].strip(): part for part in parts[1:]}


def table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines() if line.startswith("| ")]


def documented_defaults(section: str) -> dict[str, str]:
    """Flag -> the default cell of the table row that documents it."""
    found = {}
    for row in table_rows(section):
        for flag in FLAG.findall(row[0]) if row[0].startswith("`-") else []:
            found[flag] = row[1] if len(row) > 2 else ""
    return found


def test_cli_md_documents_every_flag_of_every_command_with_its_default() -> None:
    text = (DOCS / "cli.md").read_text()
    by_title = sections(text)
    for title, parser in command_parsers().items():
        matches = [t for t in by_title if t.startswith(title)]
        assert matches, f"cli.md has no section '## {title}'"
        section = by_title[matches[0]]
        documented = documented_defaults(section)
        flags = listed_flags(parser)
        for flag, action in flags.items():
            twin = flag.replace("_", "-")
            if "_" in flag and twin in flags:
                continue  # torchrun's spelling; cli.md says every dash flag has one
            assert flag in documented, f"cli.md, section {title}: no table row for {flag}"
        for flag in documented:
            assert flag in flags, f"cli.md, section {title}: {flag} is not a flag of this command"
        for flag, cell in documented.items():
            action = flags[flag]
            default = action.default
            if action.required:
                assert "required" in cell, f"{title} {flag}: required, the table says {cell!r}"
            elif default not in (None, False, [], "", argparse.SUPPRESS) and isinstance(default, (str, int, float)):
                shown = re.findall(r"`([^`]*)`", cell)
                assert shown, f"{title} {flag}: the default {default!r} is not given (cell {cell!r})"
                value = shown[0]
                same = value == str(default)
                if not same and isinstance(default, float):
                    same = re.fullmatch(r"[0-9.]+", value) is not None and float(value) == default
                assert same, f"{title} {flag}: default is {default!r}, cli.md says {value!r}"


def test_cli_md_names_no_flag_that_does_not_exist() -> None:
    known = set()
    for parser in command_parsers().values():
        known |= set(listed_flags(parser))
    text = (DOCS / "cli.md").read_text()
    code = " ".join(re.findall(r"`([^`]*)`", text))
    named = {f for f in FLAG.findall(code) if f.startswith("--")}
    assert named, "no flags found in cli.md"
    assert named - known == set(), f"cli.md names flags that do not exist: {sorted(named - known)}"


def test_cli_md_lists_every_rdzv_conf_key() -> None:
    text = (DOCS / "cli.md").read_text()
    table = sections(text)
    part = text[text.index("### `--rdzv-conf` keys"):]
    part = part[: part.index("\n### ")]
    keys = {k for row in table_rows(part)[1:] for k in re.findall(r"`(\w+)`", row[0])}
    assert table and keys == set(RDZV_CONF_KEYS), f"missing {set(RDZV_CONF_KEYS) - keys}, unknown {keys - set(RDZV_CONF_KEYS)}"


def test_cli_md_lists_every_torchrun_rdzv_conf_key() -> None:
    """Each of torchrun's names: in the alias table, or named among those without effect."""
    text = (DOCS / "cli.md").read_text()
    part = text[text.index("### torchrun's `--rdzv-conf` keys"):]
    part = part[: part.index("\n### ")]
    rows = table_rows(part)[1:]
    aliased = {k for row in rows for k in re.findall(r"`(\w+)`", row[0])}
    assert aliased == {*RDZV_CONF_ALIASES, KEEP_ALIVE_ATTEMPTS}
    for row in rows:
        for name in re.findall(r"`(\w+)`", row[0]):
            if name in RDZV_CONF_ALIASES:
                assert f"`{RDZV_CONF_ALIASES[name]}`" in row[1], row
    without_effect = part[part.index("no counterpart"):]
    assert all(f"`{key}`" in without_effect for key in RDZV_CONF_TORCHRUN_ONLY)


def test_the_flag_check_can_fail() -> None:
    """The section check notices a flag the table lacks and a flag that is not there."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--alpha", default="1")
    parser.add_argument("--beta", default=2.0, type=float)
    documented = documented_defaults("| flag | default | meaning |\n|---|---|---|\n| `--alpha` | `1` | a |\n| `--gamma` | | c |\n")
    flags = listed_flags(parser)
    assert "--beta" not in documented and "--gamma" not in flags
    assert documented["--alpha"] == "`1`"


# --- troubleshooting.md ---------------------------------------------------------------------

#: errors no command line can cause: code paths for programming mistakes and tooling
INTERNAL = (
    "protoc failed on",  # the stub generator, for contributors
    "multi_set got",  # a malformed request from our own client library
    "no new round without a restart request",  # static rendezvous misuse, internal
    "request_restart() before any round",
    "a lease TTL must be a positive number of seconds",  # in-memory store API
)

#: messages written in errors.py's constructors
CONSTRUCTED = ("is unreachable: ", "has expired or was revoked", "has been compacted (oldest kept: ", "is closed (")


def _error_names() -> set[str]:
    names = {n for n, o in vars(errors).items() if isinstance(o, type) and issubclass(o, errors.ElasticrunError)}
    for path in (ROOT / "elasticrun").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(getattr(b, "id", "") in names for b in node.bases):
                names.add(node.name)
    return names


def _literal_parts(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant)]
    if isinstance(node, ast.IfExp):
        return _literal_parts(node.body) + _literal_parts(node.orelse)
    return []


def raised_messages() -> list[tuple[str, list[str]]]:
    """(where, the fixed pieces of its message) for every error elasticrun raises."""
    names = _error_names()
    found = []
    for path in sorted((ROOT / "elasticrun").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            call = node.exc if isinstance(node, ast.Raise) else node.value if isinstance(node, ast.Return) else None
            if not isinstance(call, ast.Call) or not call.args:
                continue
            func = call.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name in names:
                pieces = [p.strip() for p in _literal_parts(call.args[0]) if len(p.strip()) >= 6]
                if pieces:
                    found.append((f"{path.relative_to(ROOT)}:{node.lineno}", pieces))
    return found


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("`", ""))


def test_troubleshooting_quotes_every_error_a_user_can_see() -> None:
    doc = _normal((DOCS / "troubleshooting.md").read_text())
    messages = raised_messages()
    assert len(messages) > 60, "the error scan found too little: is it broken?"
    missing = []
    for where, pieces in messages:
        if any(p.startswith(i) or i in p for p in pieces for i in INTERNAL):
            continue
        for piece in pieces:
            if _normal(piece) not in doc:
                missing.append(f"{where}: {piece!r}")
    for piece in CONSTRUCTED:
        if piece not in doc:
            missing.append(f"elasticrun/errors.py: {piece!r}")
    assert not missing, "troubleshooting.md lacks:\n" + "\n".join(missing)


def test_the_error_scan_finds_known_messages() -> None:
    texts = [p for _, pieces in raised_messages() for p in pieces]
    assert "--nnodes must be N or MIN:MAX, got" in texts
    assert any("drain fewer, or stop the job" in p for p in texts)


# --- links ------------------------------------------------------------------------------------


def test_relative_links_in_the_docs_resolve() -> None:
    pages = [*sorted(DOCS.glob("*.md")), ROOT / "README.md", ROOT / "examples" / "kubernetes" / "README.md"]
    expected = {
        "concepts.md", "cli.md", "backends.md", "deployment.md", "troubleshooting.md", "migration.md", "architecture.md",
    }
    assert expected <= {p.name for p in pages}
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (page.parent / target).resolve()
            if ROOT not in path.parents or not path.exists():  # a clone holds nothing outside itself
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_migration_md_maps_every_torchrun_flag() -> None:
    """The table of torchrun's interface names each of its flags (by its first spelling)."""
    from torch.distributed.run import get_args_parser

    text = (DOCS / "migration.md").read_text()
    part = text[text.index("### Every torchrun flag and variable"):]
    part = part[: part.index("\n## ")]
    named = {k for row in table_rows(part)[1:] for k in re.findall(r"`(-[-\w]+)`", row[0])}
    flags = {
        next(o for o in action.option_strings if o.startswith("--") and "_" not in o)
        for action in get_args_parser()._actions
        if action.option_strings and action.dest != "help"
    }
    assert flags - named == set(), sorted(flags - named)
