"""The Python packages a GPU machine without network access needs to run this project, installed into one folder
there, for `bash benchmarks/gpu_checks.sh pack` (an HPC node without network is the usual case).

Which packages: every top-level import in the project's Python files (the scripts, toy_chain_env.py, tests/ and
benchmarks/, read from their source) that an installed distribution provides here, and everything those require on
the target (their environment markers evaluated for its Python and platform), less
  - what the target already has: --present, a file of package names, one per line (`pip freeze` lines and comments
    allowed; by default benchmarks/gpu_image_packages.txt), and always torch with its CUDA libraries, whose build is
    the target's own;
  - --leave-out: packages the GPU checks never import (by default EnvPool, about 700 MB with its ROMs and assets;
    MuJoCo, whose tasks run on CPUs; wandb, for --track only; JAX and rlax, the CPU reference of two tests; and the
    git and motion-planning packages that ManiSkill requires but never imports in these scripts).
Each is downloaded as a wheel for the target at the version installed here (so the target runs what was tested here)
and installed with `pip install --target` for the target's platform.

  python benchmarks/wheelhouse.py --site /tmp/site                        # CPython 3.12, manylinux x86-64
  python benchmarks/wheelhouse.py --site /tmp/site --python-version 3.11 --present my_node_packages.txt
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tyro
from packaging.markers import Marker
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
ALWAYS_PRESENT = ("torch", "triton")  # and every nvidia-* package: the target's CUDA build of torch and its libraries
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")


@dataclass
class Options:
    site: str
    """the folder to install into (made if absent)"""
    python_version: str = "3.12"
    """the target's Python (major.minor)"""
    present: str = str(ROOT / "benchmarks" / "gpu_image_packages.txt")
    """a file naming the packages the target already has"""
    leave_out: tuple[str, ...] = (
        "envpool",
        "mujoco",
        "mujoco-core",
        "mujoco-studio",
        "wandb",
        "jax",
        "rlax",
        "gitpython",
        "mplib",
        "toppra",
    )
    """packages (and what only they require) not to pack"""
    dry_run: bool = False
    """print the packages and versions, download nothing"""


def normalized(name: str) -> str:
    """A distribution's name as pip compares names (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_modules() -> set[str]:
    """The top-level modules the project's Python files import, anywhere in them (inside functions too)."""
    files = [*ROOT.glob("*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/*.py")]
    modules = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules.add(node.module.split(".")[0])
    return modules - set(sys.stdlib_module_names)


def target_environment(python_version: str) -> dict[str, str]:
    """The values of environment markers on the target: Linux, x86-64, CPython `python_version`."""
    return {
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "platform_machine": "x86_64",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "extra": "",
    }


def packages_to_pack(options: Options) -> dict[str, str]:
    """{name: version installed here} of every package to pack: the imports' distributions and what they require on
    the target, less what it has and what is left out."""
    present = {normalized(line.split("#")[0].split("==")[0].strip()) for line in open(options.present)}
    skipped = present | {normalized(name) for name in (*ALWAYS_PRESENT, *options.leave_out)}
    providers = metadata.packages_distributions()
    pending = [name for module in sorted(imported_modules()) for name in providers.get(module, [])]
    environment = target_environment(options.python_version)
    found: dict[str, str] = {}
    while pending:
        name = normalized(pending.pop())
        if name in found or name in skipped or name.startswith("nvidia-"):
            continue
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:  # required on the target only (another platform's extra, ...)
            print(f"not installed here, so not packed: {name}")
            continue
        found[name] = distribution.version
        for line in distribution.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or Marker(str(requirement.marker)).evaluate(environment):
                pending.append(requirement.name)
    return found


def main(options: Options) -> None:
    packages = packages_to_pack(options)
    for name, version in sorted(packages.items()):
        print(f"{name}=={version}")
    if options.dry_run:
        return
    target = ["--python-version", options.python_version, "--implementation", "cp", "--only-binary=:all:"]
    for platform in PLATFORMS:
        target += ["--platform", platform]
    pip = [sys.executable, "-m", "pip"]
    with tempfile.TemporaryDirectory() as wheels:
        pinned = [f"{name}=={version}" for name, version in sorted(packages.items())]
        subprocess.run([*pip, "download", "-q", "--no-deps", "-d", wheels, *target, *pinned], check=True)
        downloaded = sorted(str(path) for path in Path(wheels).glob("*.whl"))
        install = [*pip, "install", "-q", "--no-deps", "--no-compile", "--target", options.site, *target]
        subprocess.run([*install, *downloaded], check=True)
    print(f"{len(packages)} packages installed into {options.site} for CPython {options.python_version}")


if __name__ == "__main__":
    main(tyro.cli(Options))
