"""The user docs: the README stays one screen, no paragraph is written twice, and every link and
path the docs name exists inside the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_LIMIT = 12_000  # bytes: the README is one screen; the rest lives in docs/
# Paths inside the repository that docs name in backticks (`recipes/x.py`, `docs/x.md`).
REPO_DIRS = ("benchmarks", "ckpt", "conf", "docs", "gtp", "mcore_compat", "recipes", "scripts",
             "tests")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(r"`((?:%s)/[\w./-]*\w)`" % "|".join(REPO_DIRS))
PLACEHOLDER = re.compile(r"\b[A-Z]{3,}\b")  # conf/experiment/NAME.yaml


def doc_pages() -> list[Path]:
    """The README, every docs/*.md page and benchmarks/README.md."""
    return [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks, whitespace collapsed, fenced code blocks left out."""
    text = re.sub(r"(?ms)^```.*?^```", "", text)
    return [" ".join(block.split()) for block in re.split(r"\n\s*\n", text) if block.strip()]


def test_readme_is_one_screen():
    size = README.stat().st_size
    assert size < README_LIMIT, f"README.md is {size} bytes; move sections into docs/"


def test_no_paragraph_is_written_twice():
    seen: dict[str, str] = {}
    twice = []
    for page in doc_pages():
        for para in paragraphs(page.read_text()):
            if len(para) < 80:  # headings, short table rows and captions may repeat
                continue
            where = f"{page.relative_to(ROOT)}"
            if para in seen:
                twice.append((seen[para], where, para[:100]))
            seen.setdefault(para, where)
    assert twice == []


def test_every_link_resolves_inside_the_repository():
    bad = []
    for page in doc_pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                bad += [(str(page.relative_to(ROOT)), target)] if target.startswith("file:") else []
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if ROOT not in path.parents or not path.exists():
                bad.append((str(page.relative_to(ROOT)), target))
    assert bad == []


def test_every_repository_path_the_docs_name_exists():
    missing = [(str(page.relative_to(ROOT)), name) for page in doc_pages()
               for name in PATH.findall(page.read_text())
               if not (ROOT / name).exists() and not PLACEHOLDER.search(name)]
    assert missing == []


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t.split("#")[0]).resolve() for t in LINK.findall(README.read_text())}
    assert [str(p.relative_to(ROOT)) for p in doc_pages()[1:] if p.resolve() not in linked] == []


def project_files() -> list[Path]:
    """The repository's own text files: the top level's and those of its source folders and
    ``.ci/`` (no virtualenv, outputs or caches)."""
    top = [p for p in ROOT.iterdir() if p.is_file() and not p.name.startswith(".")]
    nested = [p for d in (*REPO_DIRS, ".ci") for p in sorted((ROOT / d).rglob("*"))
              if p.is_file() and "__pycache__" not in p.parts and "golden" not in p.parts]
    return top + nested


def test_no_project_file_points_outside_the_repository():
    """No absolute path of a machine (a worktree or a home dir) in a project file."""
    outside = re.compile(r"(^|[^\w.])/(work|home|Users)/[\w.-]")
    hits = []
    for path in project_files():
        if path == Path(__file__).resolve():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        hits += [f"{path.relative_to(ROOT)}:{i}" for i, line in enumerate(text.splitlines(), 1)
                 if outside.search(line)]
    assert hits == []
