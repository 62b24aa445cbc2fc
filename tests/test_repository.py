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
    """Where folders lie beside the repository (a team's notes, say; not other git checkouts, nor what lies in them),
    none of their files' names is cited here, unless the repository has a file of that name too."""
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
            checkouts = [git.parent for git in sibling.rglob(".git")]  # (other checkouts inside it: not notes)
            files = [path for path in sibling.rglob("*") if path.is_file() and not path.name.startswith(".")]
            beside |= {path.name for path in files if not any(path.is_relative_to(git) for git in checkouts)}
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


SCRIPTS = ("ppo_staggered.py", "ppo_ver.py", "cleanba_ppo.py", "cleanba_impala.py", "pql.py")


def help_flags(script: str) -> set[str]:
    """Every --flag that `python <script> --help` lists (tyro: `--env-id STR`, `--cuda, --no-cuda`, `--toy.horizon`)."""
    result = subprocess.run(
        ["python3", script, "--help"], capture_output=True, text=True, cwd=ROOT, env={**os.environ, "COLUMNS": "200"}
    )
    assert result.returncode == 0, f"{script} --help failed:\n{result.stderr[-2000:]}"
    return set(re.findall(r"--[\w][\w.-]*", result.stdout))


def script_path(name: str) -> str:
    """A script the README names, as a path from the root (a benchmark may be named without its folder)."""
    return name if Path(ROOT, name).is_file() or not Path(ROOT, "benchmarks", name).is_file() else f"benchmarks/{name}"


def readme_flags() -> dict[str, set[str]]:
    """{script: the --flags the README shows for it}: on a command line that runs it (a line of a code block, or an
    inline `script.py --flag`), on a line of a general section that names it (the benchmarks' table), and in the
    section that describes it ("a.py|b.py" for Cleanba's two); "*": those of the other general lines, which must be
    some script's. A pair `--a/--no-a` counts as both flags; `--toy.*` stands for all the toy chain's flags."""
    shown: dict[str, set[str]] = {"*": set()}
    section = "*"
    in_block = False
    flag = r"--[\w][\w-]*(?:\.[\w][\w-]*)*\.?"  # (`--toy.*`: "--toy.", a prefix)
    for line in Path(ROOT, "README.md").read_text().splitlines():
        if line.startswith("```"):
            in_block = not in_block
            continue
        if line.startswith("## "):
            section = "|".join(script for script in SCRIPTS if f"`{script}`" in line) or "*"
        spans = [line.split("#")[0]] if in_block else re.findall(r"`([^`]*)`", line)
        line_owner = section
        for span in spans:
            command = re.search(r"(\S+\.py)\b(.*)", span)
            if command and Path(ROOT, script_path(command.group(1))).is_file():  # (not another project's ppo.py)
                script = script_path(command.group(1))
                shown.setdefault(script, set()).update(re.findall(flag, command.group(2)))
                if section == "*" and not command.group(2).strip():
                    line_owner = script  # (a general line about one script: its other spans' flags are its own)
        for span in [] if in_block else spans:  # (a code block's line that runs no script: another tool's flags)
            if not re.search(r"\S+\.(py|sh)\b", span):  # (a shell script's flags: not a Python script's)
                shown.setdefault(line_owner, set()).update(re.findall(flag, span))
    return shown


def test_every_flag_the_readme_shows_is_in_its_scripts_help():
    """A flag the README shows for a script (or a benchmark) is one `--help` of that script lists; one shown in a
    section about two scripts is in one of them at least; one in a general section is in some script's."""
    shown = readme_flags()
    helps = {script: help_flags(script) for script in SCRIPTS}
    missing = []
    for where, flags in shown.items():
        if where == "*":
            candidates = list(helps.values())
        elif where in helps or "|" in where:
            candidates = [helps[script] for script in where.split("|")]
        else:  # a benchmark's
            candidates = [help_flags(where)]
        for flag in sorted(flags):
            names = {name for help in candidates for name in help}
            if flag not in names and not (flag.endswith(".") and any(name.startswith(flag) for name in names)):
                missing.append(f"{where}: {flag}")
    assert not missing, missing


def test_every_file_the_readme_names_exists():
    """Results files, figures and scripts named in the README's code spans (`benchmarks/...`, `runs/` excluded)."""
    text = Path(ROOT, "README.md").read_text()
    named = set(re.findall(r"(?<![\w/.-])((?:benchmarks|tests|\.ci)/[\w./-]+\.\w+)", text))
    missing = sorted(name for name in named if not Path(ROOT, name).exists())
    assert not missing, missing
