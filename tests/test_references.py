"""What the code and the docs cite exists: every file they name, and every number README.md quotes
beside a link to a doc.

A name is a file name ending in .py, .sh or .md, in a comment, a docstring or a document (Markdown,
the Makefile, shell scripts, requirements). It resolves to a file of the repository by its
path, from the root or from the naming file's folder, or, bare, by its file name. Besides those:
what a run writes (under runs/, and the reports below), what a student's copy holds besides the
project's files, a short list of other projects' files, and
scripts retired from the repository that a document cites beside a commit that holds them."""

import ast
import io
import os
import re
import shutil
import subprocess
import tokenize
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOT_SOURCES = {
    ".git",
    ".venv",
    ".venv-trl",
    "runs",
    "__pycache__",
    ".pytest_cache",
    ".hypothesis",
    ".ruff_cache",
}
SCANNED_SUFFIXES = {".py", ".md", ".sh", ".txt"}
NAME = re.compile(r"(?<![\w./-])((?:\.\.?/)*[A-Za-z0-9_][\w./-]*\.(?:py|sh|md))(?!\w)")

# Written by a run into its --out (bench/*.py, evaluate.py, srt/report.py, pool_replicates.py), never
# committed; so is everything under runs/.
RUN_OUTPUTS = {"results.md", "report.md", "pooled.md", "check.md"}
# Written by srt/exercises.py into a student's copy only: what marks the copy and tells how to grade it.
COPY_OUTPUTS = {"EXERCISES.md"}
# Files of other projects, named where this one follows or reimplements them.
EXTERNAL = {
    # GRPO-Zero's training script: stage 2's rollout / advantages / update split follows it
    "train.py",
    # LoCoMo's official scorer (snap-research/locomo), which srt/locomo_eval.py reimplements
    "evaluation.py",
    "task_eval/evaluation.py",
    # the MGShopDial dataset's description of its schema, which srt/data/corpora.py reads
    "MGShopDial/README.md",
}
# Names a doc still gives to a file that moved or was retired, with what the doc should say instead.
# Strict: once the doc says it, the case passes and its entry goes.
STALE: dict[tuple[str, str], str] = {}
RETIRED_AT = {"bench/locomo_window.py": "a4c33c9"}  # the commits STALE gives for retired scripts


def repository_files() -> list[Path]:
    found = []
    for root, dirs, names in os.walk(REPO):
        dirs[:] = sorted(d for d in dirs if d not in NOT_SOURCES)
        if Path(root) == REPO:  # exercises/ at the root: a student copy of the project (make exercises)
            dirs[:] = [d for d in dirs if d != "exercises"]
        found += [Path(root, name).relative_to(REPO) for name in sorted(names)]
    return found


FILES = repository_files()
PATHS = {f.as_posix() for f in FILES}
SCANNED = [f for f in FILES if f.suffix in SCANNED_SUFFIXES or f.name == "Makefile"]


def cited_text(path: Path) -> list[tuple[int, str]]:
    """(line, text) of what names files: a document whole; of Python, its comments and docstrings."""
    source = (REPO / path).read_text(encoding="utf-8")
    if path.suffix != ".py":
        return [(1, source)]
    pieces = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                pieces.append((node.body[0].lineno if node.body else 1, doc))
    return pieces


def in_paths(name: str, paths, folder: Path) -> bool:
    """By its path (from the root, from `folder`, or as the end of a path), or bare by its file name."""
    if os.path.normpath(name) in paths or os.path.normpath(folder / name) in paths:
        return True
    stripped = re.sub(r"^(\.\.?/)+", "", name)
    return any(p == stripped or p.endswith("/" + stripped) for p in paths)


def git(*args) -> str | None:
    if shutil.which("git") is None:
        return None
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


@cache
def files_at(commit: str) -> frozenset[str] | None:
    listed = git("ls-tree", "-r", "--name-only", commit)
    return None if listed is None else frozenset(listed.split())


def commits_named(text: str) -> list[str]:
    """Abbreviated or full commit hashes: hex words of 7-40 characters with a digit and a letter."""
    return re.findall(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", text)


def unresolved(path: Path) -> list[tuple[int, str]]:
    text = (REPO / path).read_text(encoding="utf-8")
    commits = commits_named(text)
    missing = []
    for line, piece in cited_text(path):
        for match in NAME.finditer(piece):
            name = match.group(1)
            if name.startswith("runs/") or Path(name).name in RUN_OUTPUTS | COPY_OUTPUTS or name in EXTERNAL:
                continue
            if in_paths(name, PATHS, path.parent):
                continue
            at_commits = [files_at(c) for c in commits]
            if any(files is not None and in_paths(name, files, path.parent) for files in at_commits):
                continue  # retired, cited with a commit that holds it
            if commits and git("rev-parse", "--git-dir") is None:
                continue  # no history to check the commit against: taken as cited
            missing.append((line + piece[: match.start()].count("\n"), name))
    return missing


@pytest.mark.parametrize("path", SCANNED, ids=str)
def test_every_file_a_comment_docstring_or_doc_names_exists(path):
    missing = [
        f"{path}:{line}: {name}" for line, name in unresolved(path) if (path.as_posix(), name) not in STALE
    ]
    assert not missing, "names no file of the repository (nor a retired one with its commit):\n" + "\n".join(
        missing
    )


@pytest.mark.parametrize(
    "path, name",
    [
        pytest.param(path, name, marks=pytest.mark.xfail(strict=True, reason=reason))
        for (path, name), reason in STALE.items()
    ],
)
def test_a_doc_names_a_moved_or_retired_file_where_it_is(path, name):
    assert name not in [n for _, n in unresolved(Path(path))]


def test_the_retired_scripts_exist_at_the_commits_given_for_them():
    if git("rev-parse", "--git-dir") is None:
        pytest.skip("no git history here")
    for name, commit in RETIRED_AT.items():
        assert name in (files_at(commit) or ()), f"{name} is not in commit {commit}"


# ---- numbers ---------------------------------------------------------------------------------
DOC_LINK = re.compile(r"\]\(((?:\./)?docs/[^)#\s]*)(?:#[^)]*)?\)")
DECIMAL = re.compile(r"(?<![\w.])[+-]?(\d+\.\d+)(?![\d.]*\d)")  # 58.1, +27.0; not a version like 2.13.0


def quoted_numbers_missing(readme: str) -> list[str]:
    """Each decimal of a README paragraph that links docs/..., unless one of the docs it links holds
    it (the same digits, not inside a longer number)."""
    missing = []
    for paragraph in re.split(r"\n\s*\n", readme):
        targets = DOC_LINK.findall(paragraph)
        if not targets:
            continue
        docs = []
        for target in targets:
            doc = REPO / target
            docs.append((doc / "README.md" if doc.is_dir() else doc).read_text(encoding="utf-8"))
        prose = re.sub(r"\]\([^)]*\)", "]", paragraph)  # the link targets hold no quoted numbers
        for match in DECIMAL.finditer(prose):
            found = re.compile(r"(?<![\d.])" + re.escape(match.group(1)) + r"(?!\d)")
            if not any(found.search(doc) for doc in docs):
                first_words = " ".join(paragraph.split()[:8])
                missing.append(f"{match.group(0)} (in '{first_words} ...', linking {', '.join(targets)})")
    return missing


def test_every_number_readme_quotes_beside_a_doc_link_is_in_that_doc():
    missing = quoted_numbers_missing((REPO / "README.md").read_text(encoding="utf-8"))
    assert not missing, "README numbers that no linked doc holds:\n" + "\n".join(missing)


def test_the_number_check_sees_a_number_the_doc_lacks():
    readme = "Pooled +3.8 [+0.3, +7.6], F1 99.91 ([report](docs/experiments/grpo-replicates.md))."
    (missing,) = quoted_numbers_missing(readme)
    assert missing.startswith("99.91 (in 'Pooled +3.8") and missing.endswith("grpo-replicates.md)")


def test_the_name_check_sees_a_missing_file_and_a_retired_one_without_its_commit():
    assert in_paths("srt/recall.py", PATHS, Path("."))
    assert in_paths("../docs/gpu.md", PATHS, Path("bench"))
    assert not in_paths("srt/no_such_module.py", PATHS, Path("."))
    assert not in_paths("decode_floor.py", PATHS, Path("bench"))
    assert commits_named("run at commit 657d9bb, not 2026 nor deadbeef0") == ["657d9bb", "deadbeef0"]


def test_bench_holds_only_what_its_readme_describes():
    """bench/README.md's first table names every file of bench/, each with what it is."""
    readme = (REPO / "bench" / "README.md").read_text(encoding="utf-8")
    described = set(re.findall(r"^\| `([^`]+)` \|", readme.split("\n## ")[0], flags=re.M))
    present = {p.name for p in (REPO / "bench").iterdir() if p.name != "__pycache__"}
    assert present == described
