"""The documentation stays in step with the code.

- docs/cli.md documents every flag that `--help` of the launcher and of each subcommand
  lists, in that command's section, with the parser's default; and it names no flag
  (anywhere) that does not exist. Its `--rdzv-conf` key table, and README.md's, list the
  keys of `rdzv_conf.RDZV_CONF` with their defaults.
- docs/troubleshooting.md quotes every error message a user can see: the fixed text of
  every error raised in elasticrun/ (found in the source), save a few internal ones, and
  of every warning logged; and every message it quotes (by its stated convention) is
  text the code prints.
- Every relative link between the docs (and from README.md) points at a file that exists
  in this repository: a clone has nothing beside it to link to.
- docs/architecture.md's module map names every module of the package, once.
"""

from __future__ import annotations

import argparse
import ast
import functools
import gc
import itertools
import re
from pathlib import Path

import pytest

import elasticrun.errors as errors
from elasticrun.launcher.cli import launch_parser, subcommand_parser
from elasticrun.launcher.rdzv_conf import (
    KEEP_ALIVE_ATTEMPTS,
    RDZV_CONF_ALIASES,
    RDZV_CONF_KEYS,
    RDZV_CONF_TORCHRUN_ONLY,
)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FLAG = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")


@functools.cache
def _trees() -> dict[Path, ast.Module]:
    """The syntax trees of elasticrun's modules and of argparse (whose messages the CLI
    prints), built at once with the garbage collector off.

    At once: the scans below walk every module, and a collection costs more than a build
    (80 ms in a process that imported torch; the scans took three minutes of CI's
    fifteen when each built every tree again, a collection before each).

    Off: CPython 3.11.7 keeps one depth count per interpreter while it builds a tree: a
    finalizer that runs during the build (another test's garbage, such as a gRPC server
    whose __del__ prints a traceback, which parses a source line to place its carets)
    moves that count, and the build fails with "AST constructor recursion depth mismatch"
    (seen once in CI's order of the tests)."""
    paths = [*sorted((ROOT / "elasticrun").rglob("*.py")), Path(argparse.__file__)]
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        return {path: ast.parse(path.read_text()) for path in paths}
    finally:
        if enabled:
            gc.enable()


def _parse(path: Path) -> ast.Module:
    """`path`'s syntax tree: one of elasticrun's modules, or argparse."""
    return _trees()[path]


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
    for name in ("status", "list", "logs", "stacks", "join", "drain", "stop"):
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
    return [
        [c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines() if line.startswith("| ")
    ]


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
        for flag in flags:
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


def rdzv_conf_table(page: Path, heading: str) -> list[list[str]]:
    """The rows of the `--rdzv-conf` key table under `heading` (up to the next heading)."""
    text = page.read_text()
    part = text[text.index(heading) + len(heading):]
    part = part[: m.start()] if (m := re.search(r"^#", part, flags=re.M)) else part
    return table_rows(part)[1:]


@pytest.mark.parametrize(
    ("page", "heading"),
    [(DOCS / "cli.md", "### `--rdzv-conf` keys"), (ROOT / "README.md", "## Rendezvous settings")],
    ids=["cli.md", "README.md"],
)
def test_rdzv_conf_tables_say_what_the_key_table_says(page: Path, heading: str) -> None:
    """Every key of `RDZV_CONF` once, and its default as the table has it: a plain value
    (a number, true or false) leads the default column, a default in words is there in
    the page's own words, and a key without one has none."""
    rows = rdzv_conf_table(page, heading)
    named = [(k, row[1].replace("`", "")) for row in rows for k in re.findall(r"`(\w+)`", row[0])]
    keys = [k for k, _ in named]
    assert sorted(keys) == sorted(RDZV_CONF_KEYS), f"missing {set(RDZV_CONF_KEYS) - set(keys)}, unknown or twice: " \
        f"{sorted(k for k in keys if k not in RDZV_CONF_KEYS or keys.count(k) > 1)}"
    for key, default in named:
        conf_key = RDZV_CONF_KEYS[key]
        if conf_key.plain_default is not None:
            assert re.match(rf"{re.escape(conf_key.plain_default)}(?![\w.])", default), (key, default)
        elif conf_key.shown is not None:
            assert default, key
        else:
            assert not default, (key, default)


def test_the_rdzv_conf_check_can_fail(tmp_path: Path) -> None:
    """A wrong default, a missing key and a default where there is none are each caught."""
    page = tmp_path / "page.md"
    right = {k: key.plain_default or ("in words" if key.shown else "") for k, key in RDZV_CONF_KEYS.items()}

    def check(defaults: dict[str, str]) -> None:
        table = "\n".join(f"| `{k}` | {v} | what it means |" for k, v in defaults.items())
        page.write_text(f"## Keys\n\n| key | default | meaning |\n|---|---|---|\n{table}\n")
        test_rdzv_conf_tables_say_what_the_key_table_says(page, "## Keys")

    check(right)
    missing = {k: v for k, v in right.items() if k != "closed_ttl"}
    for wrong in ({**right, "join_timeout": "6000"}, {**right, "tls_ca": "1"}, {**right, "is_host": ""}, missing):
        with pytest.raises(AssertionError):
            check(wrong)


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
    documented = documented_defaults(
        "| flag | default | meaning |\n|---|---|---|\n| `--alpha` | `1` | a |\n| `--gamma` | | c |\n"
    )
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
        for node in ast.walk(_parse(path)):
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
        for node in ast.walk(_parse(path)):
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


def logged_warnings() -> list[tuple[str, list[str]]]:
    """(where, the fixed pieces of its format) for every warning or error elasticrun logs
    (`log.warning(...)`, `logger.error(...)`, `logging.getLogger(...).warning(...)`)."""
    found = []
    for path in sorted((ROOT / "elasticrun").rglob("*.py")):
        for node in ast.walk(_parse(path)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
                continue
            owner = node.func.value
            is_logger = (isinstance(owner, ast.Name) and owner.id in ("log", "logger")) or (
                isinstance(owner, ast.Call) and getattr(owner.func, "attr", "") == "getLogger"
            )
            if is_logger and node.func.attr in ("warning", "error", "critical"):
                parts = [p.strip() for text in _literal_parts(node.args[0]) for p in PERCENT.split(text)]
                pieces = [p for p in parts if len(p) >= 6]
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


#: troubleshooting.md's quoting convention, as its opening states it: in a table whose
#: first column is headed "message", each `code span` of that column (outside
#: parentheses, which hold notes such as "(exit 2)" or "(likewise `--tee`)") is a message
#: as elasticrun prints it. `<name>` (a word or words in angle brackets, with the quotes
#: around it, if any) stands for text that varies, and so does `...`; everything else,
#: capitals such as HOST:PORT included, is printed as written.
PLACEHOLDER = re.compile(r"""['"]?<[^<>=\s][^<>]*>['"]?|\.\.\.""")
#: a %-format in a log call puts a value there
PERCENT = re.compile(r"%(?:\([^)]*\))?[-#0 +]*\d*(?:\.\d+)?[sdrfgi]")


def quoted_messages(text: str) -> list[str]:
    """Every message troubleshooting.md quotes, by its convention (PLACEHOLDER)."""
    quoted, in_messages = [], False
    for line in text.splitlines():
        if not line.startswith("|"):
            in_messages = False
            continue
        first = line.strip().strip("|").split("|")[0].strip()
        if first in ("message", "line"):
            in_messages = True
            continue
        if not in_messages or set(first) <= set("-: "):
            continue
        depth = 0
        for i, part in enumerate(first.split("`")):
            if i % 2:  # inside a code span
                if depth == 0:
                    quoted.append(part)
            else:
                depth += part.count("(") - part.count(")")
    return quoted


@functools.cache
def _module_constants(path: Path) -> dict[str, object]:
    """A module's constants (`NAME = <literal>` at its top level) and the constants it
    imports from elasticrun modules, by name: an f-string prints their values."""
    tree = _parse(path)
    found: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if len(targets) == 1 and isinstance(targets[0], ast.Name):
                try:
                    value = ast.literal_eval(node.value)
                except ValueError:
                    continue
                if isinstance(value, (int, float, str)):
                    found[targets[0].id] = value
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("elasticrun"):
            source = ROOT / (node.module or "").replace(".", "/")
            source = source / "__init__.py" if source.is_dir() else source.with_suffix(".py")
            if source.exists() and source != path:
                theirs = _module_constants(source)
                found.update({a.asname or a.name: theirs[a.name] for a in node.names if a.name in theirs})
    return found


def _fstring_pieces(node: ast.JoinedStr, constants: dict[str, object]) -> list[str]:
    """An f-string's text, a value of a known constant filled in, split where any other
    value goes."""
    pieces, current = [], ""
    for part in node.values:
        if isinstance(part, ast.Constant):
            current += str(part.value)
            continue
        assert isinstance(part, ast.FormattedValue)
        name = part.value.id if isinstance(part.value, ast.Name) else ""
        spec = part.format_spec
        spec_text = "".join(str(c.value) for c in spec.values if isinstance(c, ast.Constant)) if spec else ""
        if name in constants and part.conversion == -1:
            current += format(constants[name], spec_text)
        else:
            pieces.append(current)
            current = ""
    return [*pieces, current]


@functools.cache
def printed_texts() -> tuple[set[str], set[str], set[str], str]:
    """The fixed pieces of text that can reach a user: elasticrun's string constants and
    f-strings (the values of known constants filled in, split where another value goes),
    split again where a %-format puts a value; and those of argparse, whose messages the
    CLI prints. As (every piece whole, every prefix of one, every suffix of one, all of
    them joined)."""
    pieces: list[str] = []
    for path in [*sorted((ROOT / "elasticrun").rglob("*.py")), Path(argparse.__file__)]:
        constants = _module_constants(path) if path.is_relative_to(ROOT) else {}
        tree = _parse(path)
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr)
        }
        for node in ast.walk(tree):
            if id(node) in docstrings:
                continue  # nobody is shown a docstring
            if isinstance(node, ast.JoinedStr):
                texts = _fstring_pieces(node, constants)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                texts = [node.value]
            else:
                continue
            pieces += [p for text in texts for p in PERCENT.split(text) if p]
    whole = set(pieces)
    prefixes = {p[:k] for p in whole for k in range(1, len(p) + 1)}
    suffixes = {p[k:] for p in whole for k in range(len(p))}
    return whole, prefixes, suffixes, "\0".join(whole)


def can_print(fragment: str, texts: tuple[set[str], set[str], set[str], str]) -> bool:
    """Whether `fragment` (a message's text between placeholders) is text the code can
    print: one piece of it, or the end of one piece, whole pieces, and the start of
    another, as a value put between them at run time joins them."""
    whole, prefixes, suffixes, joined = texts
    if fragment in joined:
        return True
    n = len(fragment)
    reached = {0}
    for i in range(n):
        if i not in reached:
            continue
        for j in range(i + 1, n + 1):
            piece = fragment[i:j]
            if (i == 0 and j < n and piece in suffixes) or (0 < i and j < n and piece in whole):
                reached.add(j)
            elif 0 < i and j == n and piece in prefixes:
                return True
    return False


def unprintable(text: str) -> list[str]:
    texts = printed_texts()
    missing = []
    for message in quoted_messages(text):
        for fragment in PLACEHOLDER.split(message):
            if fragment.strip() and not can_print(fragment, texts):
                missing.append(f"{message!r}: {fragment!r}")
    return missing


def test_every_message_troubleshooting_quotes_is_printed_by_the_code() -> None:
    text = (DOCS / "troubleshooting.md").read_text()
    assert len(quoted_messages(text)) > 150, "the quote scan found too little: is it broken?"
    missing = unprintable(text)
    assert not missing, "troubleshooting.md quotes text the code never prints:\n" + "\n".join(missing)


def test_the_quote_check_can_fail() -> None:
    """A message the code does not print is found; a placeholder, a note in parentheses,
    and a value put between two pieces of code text are not mistaken for one."""
    table = (
        "| message | meaning |\n|---|---|\n"
        "| `--nnodes must be N or MIN:MAX, got '<value>'` (or `--no-such-flag`) | a |\n"
        "| `store at <endpoint> is unreachable: connection refused: the agent that hosted it is gone` | b |\n"
        "| `the launcher never says this` | c |\n"
        "| `--nnodes must be N or MAX:MIN, got <value>` | d |\n"
    )
    assert quoted_messages(table)[0] == "--nnodes must be N or MIN:MAX, got '<value>'"
    assert len(quoted_messages(table)) == 4
    assert [m.split(":")[0] for m in unprintable(table)] == [
        "'the launcher never says this'", "'--nnodes must be N or MAX"
    ]


def test_troubleshooting_quotes_every_warning_the_agent_logs() -> None:
    doc = _normal((DOCS / "troubleshooting.md").read_text())
    warnings = logged_warnings()
    assert len(warnings) > 20, "the warning scan found too little: is it broken?"
    missing = [f"{where}: {piece!r}" for where, pieces in warnings for piece in pieces if _normal(piece) not in doc]
    assert not missing, "troubleshooting.md lacks:\n" + "\n".join(missing)


def test_the_error_scan_finds_known_messages() -> None:
    texts = [p for _, pieces in raised_messages() for p in pieces]
    assert "--nnodes must be N or MIN:MAX, got" in texts
    assert any("drain fewer, or stop the job" in p for p in texts)


# --- links ------------------------------------------------------------------------------------


def test_relative_links_in_the_docs_resolve() -> None:
    pages = [*sorted(DOCS.glob("*.md")), ROOT / "README.md", ROOT / "examples" / "kubernetes" / "README.md"]
    expected = {
        "concepts.md", "cli.md", "backends.md", "deployment.md", "troubleshooting.md", "migration.md",
        "architecture.md",
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


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces
    to hyphens, `-1`, `-2`, ... after a repeat (headings inside code blocks do not count)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_links_to_a_heading_find_it() -> None:
    """A link to `page.md#anchor` (or `#anchor` on the same page) names a heading there."""
    roots = ("README.md", "CONTRIBUTING.md", "BENCHMARKS.md", "BENCHMARKS-HISTORY.md")
    pages = [*sorted(DOCS.glob("*.md")), *(ROOT / name for name in roots)]
    broken, checked = [], 0
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
            linked = (page.parent / target).resolve() if target else page
            if "://" in target or linked.suffix != ".md":
                continue
            checked += 1
            if anchor not in heading_anchors(linked):
                broken.append(f"{page.relative_to(ROOT)} -> {target}#{anchor}")
    assert checked > 20, "the link scan found too little: is it broken?"
    assert not broken, broken


def test_benchmarks_fit_a_screen() -> None:
    """BENCHMARKS.md is the summary and the latest sections; the rest is its journal's."""
    lines = len((ROOT / "BENCHMARKS.md").read_text().splitlines())
    assert lines <= 300, f"BENCHMARKS.md has {lines} lines: move what is superseded to BENCHMARKS-HISTORY.md"


def test_the_anchor_check_can_fail(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n## Stacks (bench/x.py)\n```\n# not a heading\n```\n## Stacks (bench/x.py)\n")
    assert heading_anchors(page) == {"title", "stacks-benchxpy", "stacks-benchxpy-1"}


# --- architecture.md's module map -------------------------------------------------------------

_MAP_NAME = re.compile(r"[\w/]+\.py|\w+/")


def module_map(text: str) -> list[str]:
    """The modules architecture.md's map names, as paths under elasticrun/: each line of
    the map's block starts with names (`cli.py`, `boot/sitecustomize.py`, a folder `store/`,
    several on a line) indented under their folder, then says what they are; a line that
    does not start with a name continues a description."""
    block = text[text.index("\n    elasticrun/\n") + 1 :]
    block = block[: block.index("\n\n")]
    named: list[str] = []
    folders: list[tuple[int, str]] = []
    for line in block.splitlines()[1:]:
        indent = len(line) - len(line.lstrip())
        names = list(itertools.takewhile(_MAP_NAME.fullmatch, line.split()))
        if not names:
            continue
        folders = [(i, f) for i, f in folders if i < indent]
        prefix = "".join(f for _, f in folders)
        for name in names:
            if name.endswith("/"):
                folders.append((indent, name))
            else:
                named.append(prefix + name)
    return named


def package_modules() -> list[str]:
    """Every module of elasticrun/ but the packages' __init__ and the generated stubs."""
    package = ROOT / "elasticrun"
    return sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.name != "__init__.py" and "_pb2" not in path.name
    )


def test_the_module_map_names_every_module_once() -> None:
    """docs/architecture.md's module map lists each module of the package exactly once."""
    named = module_map((DOCS / "architecture.md").read_text())
    modules = package_modules()
    assert len(modules) > 100, "the package scan found too little: is it broken?"
    assert sorted(set(named) - set(modules)) == [], "named in the map, but no such module"
    assert sorted(set(modules) - set(named)) == [], "modules the map does not name"
    assert sorted(n for n in set(named) if named.count(n) > 1) == [], "named twice"


def test_the_module_map_check_can_fail() -> None:
    text = (DOCS / "architecture.md").read_text()
    named = module_map(text)
    assert "launcher/spelling.py" in named and "store/server/memory.py" in named
    assert "worker/boot/sitecustomize.py" in named and "store/client/grpc_store.py" in named
    without = text.replace("        spelling.py ", "        ")
    assert "launcher/spelling.py" not in module_map(without)
    twice = text.replace("        run_path.py ", "        run_path.py call.py ")
    assert module_map(twice).count("worker/call.py") == 2


# --- README's demo output -------------------------------------------------------------------


def test_readme_demo_output_is_one_run() -> None:
    """README shows what `bash scripts/demo.sh` printed in one run (scripts/demo_output.py
    writes it): the node ids agree throughout, the drained node is the one drained."""
    from scripts.demo_output import demo_block, problems

    block = demo_block((ROOT / "README.md").read_text())
    assert block.count("$ elasticrun status") >= 4 and "drained " in block, block
    assert problems(block) == []


def test_the_one_run_check_can_fail() -> None:
    """Pieces of two runs are caught: a drained node no table shows (as README once had),
    a table from another run, a round that goes back, a run that did not end well."""
    from scripts.demo_output import demo_block, problems

    block = demo_block((ROOT / "README.md").read_text())
    drained = re.search(r"drained (\S+) in", block)
    assert drained
    assert any("no status table shows" in p for p in problems(block.replace(drained.group(0), "drained vm_1 in")))
    row = re.search(r"^ *(\S+) +healthy ", block, flags=re.M)  # the first table's first row
    assert row
    other_run = f"{block[:row.start(1)]}vm_1{block[row.end(1):]}"
    assert any("the table shows" in p for p in problems(other_run))
    rounds = re.findall(r"leader \S+: round (\d+)", block)
    went_back = block.replace(f": round {rounds[-1]} running", ": round 1 running")
    assert any("after round" in p for p in problems(went_back))
    assert problems(block.rsplit("node-a exited", 1)[0]) != []


def test_the_first_hour_transcript_says_what_each_step_is_about() -> None:
    """docs/troubleshooting.md's first hour is a real run (scripts/first_hour.py), and
    still holds each step's line: a step whose words changed must be run again."""
    from scripts.first_hour import missing, transcript

    text = transcript((ROOT / "docs" / "troubleshooting.md").read_text())
    assert text.count("\n$ elasticrun ") >= 9, text
    assert missing(text) == []
    assert missing(text.replace("did you mean join_timeout?", "")) == ["A misspelt --rdzv-conf key."]
