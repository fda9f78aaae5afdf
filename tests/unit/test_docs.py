"""The README's and docs' mechanical claims, checked against the code.

The README stays a front door (under 15 KB); every relative link in it and in
docs/ resolves (files and #anchors; reference-style links are defined; an external
one is a whole URL, not fetched); every `semantic ...` command they show exists
in the CLI with the options shown (long and short); docs/configuration.md lists every setting with
its variable, default and range; docs/layout.md's layers block is the import graph
of app/; docs/benchmarks.md shows every plot in benchmarks/results/. (The examples
themselves run against a real server in tests/e2e/test_readme.py.)
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import tokenize
from pathlib import Path
from urllib.parse import urlparse

import pytest

from app.cli import build_parser
from app.settings import BOUNDS, Settings
from support import import_graph

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _code(text: str) -> list[str]:
    """Fenced blocks, then inline code spans of the text outside them."""
    blocks = FENCE.findall(text)
    prose = FENCE.sub("", text)
    return blocks + re.findall(r"`([^`]+)`", prose)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}


def test_the_readme_is_a_front_door() -> None:
    size = len(README.read_bytes())
    assert size < 15_000, f"README.md is {size} bytes: move reference material into docs/"


REFERENCE = re.compile(r"^\[([^\]]+)\]:\s+(\S+)", re.MULTILINE)  # [label]: target
REFERENCE_USE = re.compile(r"\]\[([^\]]*)\]")  # [text][label]


def _targets(text: str) -> list[str]:
    """Every link target of a page's prose: inline links and reference-style definitions."""
    prose = FENCE.sub("", text)
    return LINK.findall(prose) + [target for _, target in REFERENCE.findall(prose)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_reference_style_link_is_defined(page: Path) -> None:
    prose = re.sub(r"`[^`]*`", "", FENCE.sub("", page.read_text()))
    defined = {label.lower() for label, _ in REFERENCE.findall(prose)}
    for label in REFERENCE_USE.findall(prose):
        assert label.lower() in defined, f"{page.name}: [{label}] is used but never defined"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    for target in _targets(page.read_text()):
        if re.match(r"[a-z]+:", target):
            # Not fetched here (no network in CI): it must at least be a whole URL.
            parsed = urlparse(target)
            assert parsed.scheme in ("http", "https", "mailto") and (parsed.netloc or parsed.scheme == "mailto"), \
                f"{page.name}: {target} is not a whole URL"
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.name}: {target} does not exist"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved), f"{page.name}: no heading for #{anchor} in {resolved.name}"


def test_the_readme_links_into_every_doc() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(README.read_text())}
    for doc in DOCS:
        assert doc.resolve() in linked, f"README does not link to docs/{doc.name}"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _shown_commands() -> list[tuple[str, str, list[str]]]:
    """(page, command words, tokens after) for every `semantic ...` / `./scripts/serve ...` shown."""
    found = []
    for page in PAGES:
        for code in _code(page.read_text()):
            for line in code.replace("\\\n", " ").splitlines():
                for match in re.finditer(r"(?:^|[\s/`(])(?:semantic|scripts/(serve))\s+(.*)", line):
                    rest = [word.strip("`:,.;()") for word in match.group(2).split("#")[0].split("|")[0].split()]
                    words = ["serve", *rest] if match.group(1) else rest
                    found.append((page.name, line.strip(), words))
    return found


def test_every_semantic_command_shown_exists_with_its_options() -> None:
    shown = _shown_commands()
    assert any(words[:1] == ["sql"] for _, _, words in shown) and any(words[:1] == ["serve"] for _, _, words in shown)
    for page, line, words in shown:
        parser = build_parser()
        if not words or not re.fullmatch(r"[a-z][a-z-]*", words[0]):
            continue  # prose: "semantic" followed by no command word
        commands = _subcommands(parser)
        assert words[0] in commands, f"{page}: `{line}`: no command `semantic {words[0]}`"
        parser, rest = commands[words[0]], words[1:]
        nested = _subcommands(parser)
        if nested:
            assert rest and rest[0] in nested, f"{page}: `{line}`: `semantic {words[0]}` needs one of {sorted(nested)}"
            parser, rest = nested[rest[0]], rest[1:]
        options = {s for action in parser._actions for s in action.option_strings}
        for token in rest:
            if token == "--":  # what follows is another program's (semantic launch)
                break
            if token.startswith("--") or re.fullmatch(r"-[A-Za-z]", token):
                assert token.split("=")[0] in options, f"{page}: `{line}`: no option {token}"


# -- the configuration reference -------------------------------------------------------------

def _doc_default(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Path):
        return str(value).replace(str(Path.home()), "~", 1)
    if value == "":
        return '""'
    return str(value)


def _doc_bound(value: float) -> str:
    if isinstance(value, int) and value >= 1 << 16 and value & (value - 1) == 0:
        return f"2^{value.bit_length() - 1}"
    return str(value)


def _configuration_rows() -> dict[str, list[str]]:
    rows = {}
    for line in (ROOT / "docs" / "configuration.md").read_text().splitlines():
        if line.startswith("| `"):
            cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
            rows[cells[0].strip("`")] = [cell.strip("`") for cell in cells]
    return rows


def test_the_configuration_reference_lists_every_setting_as_the_code_defines_it() -> None:
    rows = _configuration_rows()
    defaults = Settings()
    names = list(Settings.model_fields)
    assert sorted(rows) == sorted(names), "docs/configuration.md and app/settings.py list different settings"
    for name, field in Settings.model_fields.items():
        key, variable, default, bounds, meaning = rows[name][:5]
        assert variable == f"SEMANTIC_{name.upper()}", name
        assert not field.is_required(), name
        assert default == _doc_default(getattr(defaults, name)), f"{name}: default {default}"
        low_high = BOUNDS.get(name)
        expected = f"{_doc_bound(low_high[0])}..{_doc_bound(low_high[1])}" if low_high else "-"
        assert bounds == expected, f"{name}: range {bounds}, settings.py says {expected}"
        assert meaning, name


# -- the layers ------------------------------------------------------------------------------

PACKAGES = ("api", "agents", "protocol", "engine", "cache", "catalog", "store", "pool")


def _package_imports() -> dict[str, set[str]]:
    """Which packages of app/ each package imports (type-only imports included)."""
    edges: dict[str, set[str]] = {name: set() for name in PACKAGES}
    for package in PACKAGES:
        for path in (ROOT / "app" / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                         else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                for name in names:
                    parts = name.split(".")
                    if parts[0] == "app" and len(parts) > 1 and parts[1] in PACKAGES and parts[1] != package:
                        edges[package].add(parts[1])
    return edges


def _documented_layers() -> dict[str, set[str]]:
    text = (ROOT / "docs" / "layout.md").read_text()
    block = re.search(r"^```layers\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    assert block, "docs/layout.md has no ```layers block"
    layers = {}
    for line in block.group(1).strip().splitlines():
        source, _, targets = line.partition("->")
        layers[source.strip()] = {t.strip() for t in targets.split(",") if t.strip()}
    return layers


def test_the_documented_layers_are_the_imports() -> None:
    assert _documented_layers() == _package_imports()


def test_no_import_runs_back_up() -> None:
    edges = _package_imports()
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, f"import circle: {' -> '.join((*path, node))}"
        if node in done:
            return
        for target in edges[node]:
            visit(target, (*path, node))
        done.add(node)

    for package in PACKAGES:
        visit(package, ())


def test_no_module_import_points_up_or_closes_a_circle() -> None:
    """Module by module, type-only imports included (docs/layout.md#the-import-graph)."""
    graph = import_graph.edges()
    assert len(graph) > 200, "the import graph was not read"
    assert import_graph.bad_edges(graph) == {}


def _imports_mlx_at_module_level(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    return any(name.split(".")[0] in ("mlx", "mlx_lm") for name in names)


def test_mlx_is_imported_at_module_level_only_where_layout_says() -> None:
    allowed_cache = {"blocks.py", "checkpoints.py"}  # KV blocks and recurrent-state checkpoints
    for path in (ROOT / "app").rglob("*.py"):
        if _imports_mlx_at_module_level(path):
            where = path.relative_to(ROOT / "app")
            assert where.parts[0] == "engine" or (where.parts[0] == "cache" and where.name in allowed_cache), where
    text = (ROOT / "docs" / "layout.md").read_text()
    listed = re.search(r"MLX is imported at module level only by `app/engine/` \(([^)]*)\)", text)
    assert listed is not None, "docs/layout.md no longer lists the engine modules that import MLX"
    named = set(re.findall(r"`(\w+\.py)`", listed.group(1)))
    assert named == {path.name for path in (ROOT / "app" / "engine").glob("*.py") if _imports_mlx_at_module_level(path)}


# -- the benchmarks --------------------------------------------------------------------------

def test_every_benchmark_plot_is_shown() -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    for png in sorted((ROOT / "benchmarks" / "results").glob("*.png")):
        assert f"](../benchmarks/results/{png.name})" in text, f"docs/benchmarks.md does not show {png.name}"


# A measured time in the code's prose: a rate, "took N", milliseconds, a range of seconds,
# "Nx faster". Timings rot where they are written; they live in docs/benchmarks.md.
TIMING = re.compile(r"\d\s?(?:tok/s|[GMK]B/s)|\btook \d|\d(?:\.\d+)?\s?(?:ms|µs)\b|\d(?:\.\d+)?-\d+(?:\.\d+)?\s?s\b"
                    r"|\d(?:\.\d+)?x (?:faster|slower)")


def _prose(path: Path) -> list[tuple[int, str]]:
    """The comments and docstrings of a module, with their lines."""
    source = path.read_text()
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                out.append((node.body[0].lineno, docstring))
    return out


def test_no_docstring_or_comment_holds_a_measured_time() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}: {match[0]!r}"
             for path in sorted([*(ROOT / "app").rglob("*.py"), *(ROOT / "worker").rglob("*.py")])
             for line, text in _prose(path) for match in TIMING.finditer(text)]
    assert not found, ("timings belong in docs/benchmarks.md (\"Measured choices in the code\"), not in the code:\n"
                       + "\n".join(found))
