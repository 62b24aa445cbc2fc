"""The repository stands alone: no file in it names a path outside it, or a file beside it that a user who clones it
does not get, and every relative link in its markdown leads to a file in it."""

import os
import re
import subprocess
from pathlib import Path

from conftest import ROOT

TEXT_SUFFIXES = {".py", ".md", ".txt", ".sh", ".toml", ".cfg", ".ini", ".yml", ".yaml", ".patch", ""}


def tracked_text_files() -> dict[Path, str]:
    """{path: text} of every file git tracks (or would add) in the repository, text files only."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], capture_output=True, text=True, cwd=ROOT
    ).stdout.splitlines()
    files = {}
    for name in listed:
        path = Path(ROOT, name)
        if path.suffix in TEXT_SUFFIXES and path.is_file():
            files[path] = path.read_text(errors="replace")
    return files


def test_no_file_names_a_path_that_leaves_the_repository():
    """A relative path with '..' that resolves outside the repository (from the file's folder or from the root), or
    an absolute path into this machine's work folders."""
    root = Path(ROOT).resolve()
    found = []
    for path, text in tracked_text_files().items():
        for match in re.finditer(r"(?<![\w.])(?:\.\./)+[\w.-]+(?:/[\w.-]+)*", text):
            for base in (path.parent, root):
                if not (base / match.group()).resolve().is_relative_to(root):
                    found.append(f"{path.relative_to(root)}: {match.group()}")
                    break
        found += [f"{path.relative_to(root)}: {m.group()}" for m in re.finditer(r"(?<![\w.])/work/[\w./-]+", text)]
    assert not found, found


def test_no_file_names_a_file_that_lies_beside_the_repository_and_not_in_it():
    """Where folders lie beside the repository (a team's notes, say; not other git checkouts), none of their files'
    names is cited here, unless the repository has a file of that name too."""
    root = Path(ROOT).resolve()
    own_names = {path.name for path in root.rglob("*") if ".git" not in path.parts}
    beside = set()
    for sibling in root.parent.iterdir():
        if (
            sibling.is_dir()
            and sibling != root
            and not sibling.name.startswith(".")
            and not (sibling / ".git").exists()
        ):
            beside |= {path.name for path in sibling.rglob("*") if path.is_file() and not path.name.startswith(".")}
    names = beside - own_names
    found = []
    for path, text in tracked_text_files().items():
        for name in names:
            if re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", text):
                found.append(f"{path.relative_to(root)}: {name}")
    assert not found, found


def test_every_relative_link_in_the_markdown_leads_to_a_file_of_the_repository():
    found = []
    for path, text in tracked_text_files().items():
        if path.suffix != ".md":
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not os.path.exists(path.parent / target.split("#")[0]):
                found.append(f"{path.relative_to(ROOT)}: {target}")
    assert not found, found
