"""Lints the Dockerfiles where no Docker engine runs (CI): parses each with Docker's own parser
(PyPI `dockerfile`), then checks what a build would trip on or what the project promises.

    python3 .ci/check_dockerfiles.py Dockerfile Dockerfile.cuda

Fails on: an unknown instruction or one without arguments, a FROM without an image, a COPY
source missing from the build context or excluded by .dockerignore, no non-root USER, no
HEALTHCHECK on /health, no EXPOSE, or a cargo build that is not `--release --locked` (the
command .ci/run runs).
"""
import fnmatch
import pathlib
import sys

import dockerfile

KNOWN = {"from", "run", "cmd", "label", "expose", "env", "add", "copy", "entrypoint", "volume",
         "user", "workdir", "arg", "onbuild", "stopsignal", "healthcheck", "shell", "maintainer"}
ROOT = pathlib.Path(__file__).resolve().parent.parent


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path or a folder above it decides, and a
    pattern that starts with `!` lets the path back in."""
    parts = pathlib.PurePosixPath(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        allow = pattern.startswith("!")
        pat = pattern.lstrip("!")
        if any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.lstrip("*/")) for p in prefixes):
            excluded = not allow
    return excluded


def check(name: str) -> list[str]:
    problems = []
    patterns = [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines() if l.strip() and not l.startswith("#")]
    try:
        commands = dockerfile.parse_file(str(ROOT / name))
    except dockerfile.GoParseError as e:
        return [f"{name}: does not parse: {e}"]
    commands = [c._replace(cmd=c.cmd.lower()) for c in commands]
    seen = {c.cmd for c in commands}
    for c in commands:
        where = f"{name}:{c.start_line}"
        if c.cmd not in KNOWN:
            problems.append(f"{where}: unknown instruction {c.cmd.upper()}")
        if not c.value:
            problems.append(f"{where}: {c.cmd.upper()} without arguments")
        if c.cmd == "copy" and not any(f.startswith("--from") for f in c.flags):
            for src in c.value[:-1]:
                if not (ROOT / src).exists():
                    problems.append(f"{where}: COPY source {src!r} is not in the build context")
                elif ignored(src, patterns):
                    problems.append(f"{where}: COPY source {src!r} is excluded by .dockerignore")
        if c.cmd == "run" and "cargo build" in c.value[0] and not ("--release" in c.value[0] and "--locked" in c.value[0]):
            problems.append(f"{where}: cargo build must be --release --locked, as in .ci/run")
    users = [c.value[0] for c in commands if c.cmd == "user"]
    if not users or users[-1] in ("root", "0"):
        problems.append(f"{name}: the final image must run as a non-root USER")
    if not any(c.cmd == "healthcheck" and "/health" in " ".join(c.value) for c in commands):
        problems.append(f"{name}: no HEALTHCHECK on /health")
    if "expose" not in seen:
        problems.append(f"{name}: no EXPOSE")
    return problems


def main() -> None:
    problems = [p for name in sys.argv[1:] for p in check(name)]
    for p in problems:
        print(p)
    if problems:
        sys.exit(1)
    print(f"dockerfiles OK: {', '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
