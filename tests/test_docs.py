"""The docs name only paths that exist: every repository path in README.md and docs/*.md.

What counts as a repository path (``doc_paths``):
- the target of a Markdown link, ``[text](target)``, that is not a URL (``http:``,
  ``https:``, ``mailto:``) or an anchor alone; resolved against the document's folder, as a
  browser does; a ``#section`` part is dropped;
- an inline code span (single backticks) without spaces that either starts with a top-level
  folder of the repository (``meshplan/``, ``planner/``, ``costmodel/``, ``runtime/``,
  ``tests/``, ``benchmarks/``, ``docs/``, ``examples/``, ``tools/``, ``.ci/``), or is a bare
  file name ending in ``.py`` or ``.md``. A ``:name`` after a ``.py`` (a factory, a function)
  and a ``::name`` (a test) are dropped; a span that holds ``<``, ``{``, ``$``, ``=`` or ``?``
  is a pattern, not a path, and is skipped; a ``*`` makes it a glob that must match.
  A top-level path without a file extension is a folder, or a module named as code names
  it (``planner/inter``, ``planner/manual.with_cp_axis``): its ``.py`` file must exist and
  define or mention the name after the dot.
  Top-level paths are resolved against the repository root (the package folders install
  as ``meshplan.planner`` etc., but the docs name the checkout's folders); bare names must be
  the name of some file of the repository (``spmd.py``), except the few placeholder names
  in ``PLACEHOLDERS`` that the docs use for a user's own files;
- in plain text, a token that starts with one of those top-level folders (after a space, a
  parenthesis or a line start; not inside a URL) and ends in a file extension
  (``costmodel/calibrate.py``).
Fenced code blocks are skipped: they hold commands and user files (``plan.json``).
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("meshplan/", "planner/", "costmodel/", "runtime/", "tests/", "benchmarks/", "docs/",
       "examples/", "tools/", ".ci/")
PLACEHOLDERS = {"file.py", "train.py", "test_x.py", "module.py",  # a user's own files
                "tests/test_x.py"}
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
TEXT = re.compile(r"(?<![\w/.`:-])((?:%s)[\w/.-]*\w\.(?:py|md|json|png|toml|cfg))(?![\w/])"
                  % "|".join(re.escape(t) for t in TOP))


def _strip(token: str) -> str:
    token = token.split("::")[0].rstrip(".,;")
    head, sep, _ = token.partition(".py:")
    return head + ".py" if sep else token


def doc_paths(text: str) -> list[tuple[str, str]]:
    """(kind, path) for every repository path ``text`` names: kind "link" or "code"."""
    text = FENCE.sub("", text)
    out = []
    for target in LINK.findall(text):
        if re.match(r"^(https?|mailto):", target) or target.startswith("#"):
            continue
        out.append(("link", target.split("#")[0]))
    for span in CODE.findall(text):
        if " " in span or any(c in span for c in "<{$=?"):
            continue
        path = _strip(span)
        if path.startswith(TOP) or ("/" not in path and path.endswith((".py", ".md"))):
            out.append(("code", path))
    out += [("text", path) for path in TEXT.findall(CODE.sub("", text))]
    return out


def _exists(kind: str, path: str, doc: Path, names: set[str]) -> bool:
    if kind == "link":
        return (doc.parent / path).exists()
    if path in PLACEHOLDERS:
        return True
    if "/" not in path:
        return path in names
    if "*" in path:
        return bool(glob.glob(str(ROOT / path)))
    if (ROOT / path).exists():
        return True
    folder, _, last = path.rpartition("/")
    module, _, name = last.partition(".")
    source = ROOT / folder / f"{module}.py"
    if "." in last and not name.isidentifier():
        return False  # a file name with an extension that is not there
    return source.is_file() and (not name or re.search(rf"\b{name}\b", source.read_text())
                                 is not None)


@pytest.fixture(scope="module")
def repo_names() -> set[str]:
    names = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") or d == ".ci"]
        dirs[:] = [d for d in dirs if d not in ("__pycache__", "node_modules")
                   and not d.endswith(".egg-info")]
        names.update(files)
    return names


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_path_a_doc_names_exists(doc, repo_names):
    paths = doc_paths(doc.read_text())
    missing = sorted({p for kind, p in paths if not _exists(kind, p, doc, repo_names)})
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_the_rule_finds_paths_and_skips_patterns():
    text = ("See [the map](ARCHITECTURE.md#layers), `runtime/graph/spmd.py`, `spmd.py`, "
            "`examples/factories.py:convnet`, `tests/test_cli.py::test_plan`, "
            "`benchmarks/<name>.py`, `transformers:gpt2?n_layer=2`, `meshplan run plan.json`,"
            " [site](https://pytorch.org), (costmodel/calibrate.py) and"
            " https://github.com/pytorch/torchtitan/blob/main/docs/performance.md.\n```bash\nmeshplan plan -o nowhere/plan.json\n```\n")
    assert doc_paths(text) == [("link", "ARCHITECTURE.md"), ("code", "runtime/graph/spmd.py"),
                               ("code", "spmd.py"), ("code", "examples/factories.py"),
                               ("code", "tests/test_cli.py"),
                               ("text", "costmodel/calibrate.py")]
    assert not _exists("code", "planner/graph.py", ROOT / "README.md", set())
    assert _exists("code", "planner/manual.with_cp_axis", ROOT / "README.md", set())
    assert not _exists("code", "planner/manual.no_such_function", ROOT / "README.md", set())


CITE = re.compile(r"DECISIONS(?:\.md)?,? (?:entr(?:y|ies) )?(\d+)(?:\s*-\s*(\d+))?")


def test_every_cited_decision_exists():
    """"DECISIONS 61" (or "docs/DECISIONS.md 42", "DECISIONS 72-73") anywhere in the
    repository names an entry docs/DECISIONS.md has: a heading ``### 61.``."""
    text = (ROOT / "docs" / "DECISIONS.md").read_text()
    entries = {int(n) for n in re.findall(r"^### (\d+)\. ", text, re.M)}
    assert entries >= set(range(1, 74))  # the numbers cited before the regrouping stay
    cited = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"
                   and not d.endswith(".egg-info")]
        for name in files:
            if name.endswith((".py", ".md", ".cfg", ".toml")) or name == ".importlinter":
                path = Path(folder) / name
                for m in CITE.finditer(path.read_text(errors="replace")):
                    first, last = int(m.group(1)), int(m.group(2) or m.group(1))
                    cited += [(path.relative_to(ROOT), n) for n in range(first, last + 1)]
    for first, _ in CITE.findall((ROOT / ".importlinter").read_text()):
        cited.append((".importlinter", int(first)))
    assert cited
    missing = [(str(p), n) for p, n in cited if n not in entries]
    assert not missing, missing
