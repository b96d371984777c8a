"""images/requirements.lock against pyproject.toml, without building anything.

The images install only the locked wheels (images/build.sh, no index), so a dependency added to
pyproject.toml but not to the lock would be missing from the control-plane image, and one locked
outside its bound would run a version the project never tested. Renew the lock with
`.venv/bin/python images/lock.py` (docs/operator-guide.md, *Images*).
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
# The images' interpreter: Debian 12's python3 (images/base.env), which markers compare against.
IMAGE_PYTHON = {"python_version": "3.11", "python_full_version": "3.11.2"}


def locked() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "images" / "requirements.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, rest = line.split("==", 1)
            pins[canonicalize_name(name)] = rest.split()[0]
    return pins


def dependencies() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(spec) for spec in project["dependencies"]]


def applies(requirement: Requirement, extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    environment = {**default_environment(), **IMAGE_PYTHON}
    return any(
        requirement.marker.evaluate({**environment, "extra": extra}) for extra in extras | {""}
    )


def test_every_dependency_is_locked_within_its_bound() -> None:
    pins = locked()
    problems = []
    for requirement in dependencies():
        version = pins.get(canonicalize_name(requirement.name))
        if version is None:
            problems.append(f"{requirement.name} is not in images/requirements.lock")
        elif not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{requirement.name}=={version} is outside {requirement.specifier}")
    assert not problems, "\n".join(problems)


def test_what_the_locked_packages_need_is_locked_too() -> None:
    """Each locked package's own requirements (as installed here, with the project's extras),
    so a new dependency's dependencies are not forgotten when the lock is edited."""
    pins = locked()
    wanted = {canonicalize_name(r.name): set(r.extras) for r in dependencies()}
    missing = []
    for name in pins:
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # locked for the image only (e.g. pip itself)
        for spec in distribution.requires or ():
            requirement = Requirement(spec)
            if not applies(requirement, wanted.get(name, set())):
                continue
            if canonicalize_name(requirement.name) not in pins:
                missing.append(f"{requirement.name} (needed by {name})")
    assert not missing, "not in images/requirements.lock: " + ", ".join(sorted(set(missing)))
