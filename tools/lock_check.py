"""Checks that a virtual environment holds exactly what a pip-compile lock says (dev only; `make setup` runs it).

    python tools/lock_check.py requirements/test.lock [--may-lack NAME ...]

First the lock itself: every line is a comment or blank, an option line pip-compile writes (--index-url,
--extra-index-url, --find-links, --trusted-host, --no-binary, --only-binary), or one pin `name==X.Y.Z` (extras and an
environment marker allowed), whose `--hash=...` options (on backslash-continued lines, or on the lines right below
it) are the pin's hashes. A package pinned twice, a pin that is not exact (`>=`, `~=`, `<`, `==1.*`, no version, a
URL), an editable `-e` line (a lock cannot pin an editable: its version is whatever the folder holds), `-r`/`-c` or
any other line is one line of error naming the lock file and the line number.

Then the environment: every pin of the lock (whose marker holds here) must be installed at that version, and nothing
else may be installed but the project itself and pip's own tools. A torch that the venv sees from the system's
site-packages (a user's own build, kept by the set-up) is reported, not refused; so is the absence of a package named
after --may-lack (one whose tests skip, saying why, when it cannot be built).

Exit status: 0 when the environment equals the lock, 1 with one line per problem (of the lock, or a difference),
2 for bad usage (argparse's).
"""
import argparse, re, sys, sysconfig
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

TOOLS = {"pip", "setuptools", "wheel", "ilab-nb"}      # the installer's own and the project (editable)
OPTIONS = ("--index-url", "--extra-index-url", "--find-links", "--trusted-host", "--no-binary", "--only-binary")
HASH = re.compile(r"--hash[=\s]\w+:[0-9a-fA-F]+")
COMMENT = re.compile(r"(^|\s)#.*")


class LockError(Exception):
    "Why a file is not a lock: one line per problem, each naming the file (and the line)."


def read_lock(lock) -> str:
    "The lock's text; a missing or unreadable file is one line of `LockError`."
    try: return Path(lock).read_text(encoding="utf-8")
    except FileNotFoundError: raise LockError(f"{lock}: no such lock file") from None
    except IsADirectoryError: raise LockError(f"{lock}: is a directory, not a lock file") from None
    except UnicodeDecodeError: raise LockError(f"{lock}: is not UTF-8 text") from None
    except OSError as e: raise LockError(f"{lock}: cannot be read ({e.strerror})") from None


def logical_lines(text: str) -> list:
    "`(line number, text)` of each line as pip reads it: comments cut, a line ending in a backslash joined to the next."
    out, first, parts = [], None, []
    for n, raw in enumerate(text.splitlines(), 1):
        line = COMMENT.sub("", raw).strip()
        first = first or n
        parts.append(line.removesuffix("\\").strip())
        if not line.endswith("\\"):
            if joined := " ".join(p for p in parts if p): out.append((first, joined))
            first, parts = None, []
    if joined := " ".join(p for p in parts if p): out.append((first, joined))    # a backslash on the last line
    return out


def option_problem(line: str) -> str | None:
    "Why an option line is none pip-compile writes into a lock (None if it is one)."
    if line.startswith(("-e", "--editable")):
        return f"{line!r} is an editable requirement: a lock cannot pin one (its version is whatever the folder holds)"
    flag = re.split(r"[=\s]", line, maxsplit=1)[0]
    if flag in OPTIONS: return None if line[len(flag) + 1:].strip() else f"{flag} without its value"
    return f"{line!r} is not an option pip-compile writes into a lock ({', '.join(OPTIONS)}, --hash)"


def exact_version(req: Requirement) -> bool:
    "Whether `req` pins one version exactly: `==X.Y.Z`, no wildcard, no URL."
    specs = list(req.specifier)
    if req.url or len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version: return False
    try: Version(specs[0].version)
    except InvalidVersion: return False
    return True


def pin_of(line: str):
    "`(Requirement, None)` of a pin line `name==X.Y.Z [--hash=...]`, or `(None, why it is not one)`."
    req_text, *opts = re.split(r"\s+(?=--)", line)
    if bad := [o for o in opts if not HASH.fullmatch(o)]:
        return None, f"{bad[0]!r} after a pin: only --hash=ALGO:HEX may follow one"
    try: req = Requirement(req_text)
    except InvalidRequirement: return None, f"{req_text!r} is not a pin (name==X.Y.Z)"
    if exact_version(req): return req, None
    how = f"@ {req.url}" if req.url else str(req.specifier) or "no version"
    return None, f"{req.name} is not pinned exactly ({how}): a lock pins each package as name==X.Y.Z"


def add_pin(pins: dict, req: Requirement, n: int) -> str | None:
    "Add the pin of line `n` to `pins`; why not, if its package is pinned already."
    name = canonicalize_name(req.name)
    if name not in pins:
        pins[name] = (n, req)
        return None
    m, first = pins[name]
    return f"{req.name} is pinned twice (line {m}: {first.specifier}; line {n}: {req.specifier}): a lock pins it once"


def parse_lock(lock, text: str) -> dict:
    "The lock's pins `{name: (line, Requirement)}`; every line that makes it no lock, said in one `LockError`."
    pins, problems, last = {}, [], None       # last: the pin that --hash lines right below it belong to
    for n, line in logical_lines(text):
        if line.startswith("--hash"):
            why = None if last and HASH.fullmatch(line) else f"{line!r} is not a hash (--hash=ALGO:HEX) of a pin above it"
        elif line.startswith("-"): why, last = option_problem(line), None
        else:
            last, why = pin_of(line)
            why = why or add_pin(pins, last, n)
        if why: problems.append(f"{lock}, line {n}: {why}")
    if problems: raise LockError("\n".join(problems))
    return pins


def locked(lock) -> dict:
    "The lock's pins, {name: Requirement}; `LockError` if the file is not a lock."
    return {name: req for name, (_, req) in parse_lock(lock, read_lock(lock)).items()}


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
        if req.marker is not None and not req.marker.evaluate(): continue       # not for this environment
        version, where = have.get(name, (None, ""))
        if version is None and name in may_lack: print(f"lock_check: {name} is not installed (its tests skip)")
        elif version is None: out.append(f"{name}: locked at {req.specifier}, not installed")
        elif not req.specifier.contains(version, prereleases=True):
            if not where.startswith(own) and name == "torch": print(f"lock_check: keeping the system's torch {version}")
            else: out.append(f"{name}: {version} installed, the lock says {req.specifier}")
    for name, (version, where) in sorted(have.items()):
        if name not in pins and name not in TOOLS and where.startswith(own): out.append(f"{name} {version}: installed, not in the lock")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="lock_check.py", description="Check that this environment equals a pip-compile lock.")
    p.add_argument("lock", help="the lock file (requirements/test.lock)")
    p.add_argument("--may-lack", nargs="+", default=[], metavar="NAME", help="packages that may be missing (their tests skip)")
    a = p.parse_args(argv)                                                  # bad usage: argparse's exit status 2
    try: diffs = differences(a.lock, {canonicalize_name(n) for n in a.may_lack})
    except LockError as e:
        for line in str(e).splitlines(): print("lock_check:", line)
        return 1
    for d in diffs: print("lock_check:", d)
    if not diffs: print(f"lock_check: the environment equals {a.lock} ({len(locked(a.lock))} pins)")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
