"""Checks that a virtual environment holds exactly what a pip-compile lock says (dev only; `make setup` runs it).

    python tools/lock_check.py requirements/test.lock [--may-lack NAME ...]

Every `name==version` of the lock must be installed at that version, and nothing else may be installed but the
project itself and pip's own tools. A torch that the venv sees from the system's site-packages (a user's own build,
kept by the set-up) is reported, not refused; so is the absence of a package named after --may-lack (one whose
tests skip, saying why, when it cannot be built). Exit status 1 with one line per difference.
"""
import re, sys, sysconfig
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

TOOLS = {"pip", "setuptools", "wheel", "ilab-nb"}      # the installer's own and the project (editable)


def locked(lock):
    "The lock's pins, {name: Requirement}."
    lines = (l.split("#")[0].strip() for l in Path(lock).read_text().splitlines())
    return {canonicalize_name(r.name): r for r in map(Requirement, filter(None, lines))}


def installed():
    "{name: (version, path)} of every distribution this interpreter sees; the first one found wins, as for imports."
    seen = {}
    for d in metadata.distributions():
        seen.setdefault(canonicalize_name(d.metadata["Name"]), (d.version, str(d.locate_file(""))))
    return seen


def differences(lock, may_lack=()):
    pins, have, own = locked(lock), installed(), sysconfig.get_paths()["purelib"]
    out = []
    for name, req in sorted(pins.items()):
        version, where = have.get(name, (None, ""))
        if version is None and name in may_lack: print(f"lock_check: {name} is not installed (its tests skip)")
        elif version is None: out.append(f"{name}: locked at {req.specifier}, not installed")
        elif not req.specifier.contains(version, prereleases=True):
            if not where.startswith(own) and name == "torch": print(f"lock_check: keeping the system's torch {version}")
            else: out.append(f"{name}: {version} installed, the lock says {req.specifier}")
    for name, (version, where) in sorted(have.items()):
        if name not in pins and name not in TOOLS and where.startswith(own): out.append(f"{name} {version}: installed, not in the lock")
    return out


if __name__ == "__main__":
    lock, *rest = sys.argv[1:]
    may_lack = {canonicalize_name(n) for n in rest if n != "--may-lack"}
    diffs = differences(lock, may_lack)
    for d in diffs: print("lock_check:", d)
    if not diffs: print(f"lock_check: the environment equals {lock} ({len(locked(lock))} pins)")
    sys.exit(1 if diffs else 0)
