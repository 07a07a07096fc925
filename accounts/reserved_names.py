"""Builds ``accounts/data/reserved-usernames.txt``: the user and group names that Debian
packages create, read from the packages themselves. Run it as ``bin/reserved-names``.

Sources, all from the packages of the chosen Debian suites (downloaded with apt-get,
with an apt configuration of its own in a temporary folder, so the machine's sources
are neither used nor changed):

- base-passwd's ``passwd.master`` and ``group.master`` (the fixed system accounts);
- every ``sysusers.d/*.conf`` file in the packages (``u``, ``g`` and ``m`` lines);
- the maintainer scripts (``preinst``, ``postinst``, ``config``) of the packages: each
  ``adduser``, ``addgroup``, ``useradd`` and ``groupadd`` command, with shell variables
  assigned a plain value in the same script resolved.

The packages are those listed in ``accounts/data/reserved-packages.txt`` and the
packages they depend on (directly or not) that are built from the same source: a
service's accounts are often made by a sibling package (libvirt's group by
libvirt-daemon-common, dbus's messagebus by dbus-system-bus-common). The output
is sorted, one ``name<TAB>packages`` line each, under a header that says how it was
made; ``accounts.usernames`` reads the first field. Needs the network and dpkg-deb;
nothing at run time or in the tests does.
"""

from __future__ import annotations

import argparse
import datetime
import re
import shlex
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
PACKAGES_FILE = DATA / "reserved-packages.txt"
OUTPUT_FILE = DATA / "reserved-usernames.txt"
DEFAULT_SUITES = ("bookworm", "trixie")
MIRROR = "http://deb.debian.org/debian"

# A name as packages write them: lowercase mostly, some with capitals (Debian-exim),
# underscores (_apt) or a trailing $ never.
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
COMMANDS = {"adduser", "addgroup", "useradd", "groupadd"}
# Options of those commands that take a value which is not an account name.
VALUE_OPTIONS = {
    "--home", "--shell", "--gecos", "--comment", "--uid", "--gid", "--firstuid",
    "--lastuid", "--firstgid", "--lastgid", "--conf", "--add-extra-groups", "--key",
    "-d", "-s", "-c", "-u", "-g", "-K", "-k", "-e", "-f", "-p", "-b", "-R", "-P",
    "--home-dir", "--base-dir", "--expiredate", "--inactive", "--password", "--root",
    "--prefix", "--skel", "--selinux-user",
}  # fmt: skip
# groupadd's own: its -f is --force and takes nothing.
GROUPADD_VALUE_OPTIONS = {
    "-g", "--gid", "-K", "--key", "-p", "--password", "-R", "--root", "-P", "--prefix",
}  # fmt: skip
# Options whose value is a group name the command relies on or makes.
GROUP_OPTIONS = {"--ingroup", "-G", "--groups", "--gid-name"}
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")", "then", "fi", "do", "done", "else", "elif"}
ASSIGNMENT_RE = re.compile(r"^\s*(?:local\s+|readonly\s+|export\s+)?([A-Za-z_][A-Za-z0-9_]*)="
                           r"""(?:"([^"$`\\]*)"|'([^']*)'|([^\s;$`"'\\]+))\s*(?:;|$|#)""",
                           re.M)  # fmt: skip
VARIABLE_RE = re.compile(r"^\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?$")


def _logical_lines(script: str) -> list[str]:
    """The script's lines with backslash continuations joined."""
    return script.replace("\\\n", " ").splitlines()


def names_from_maintainer_script(script: str) -> set[str]:
    """Account names that the adduser/addgroup/useradd/groupadd commands of a shell
    script create or add to, with variables assigned a plain value resolved; a name
    that stays a variable is left out."""
    variables: dict[str, str] = {}
    for match in ASSIGNMENT_RE.finditer(script):
        value = next(v for v in match.groups()[1:] if v is not None)
        variables.setdefault(match.group(1), value)
    names: set[str] = set()
    for line in _logical_lines(script):
        if not any(command in line for command in COMMANDS):
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            tokens = list(lexer)
        except ValueError:  # an unbalanced quote: a line of a here-document, say
            continue
        names |= _names_in_tokens(tokens, variables)
    return names


def _names_in_tokens(tokens: list[str], variables: dict[str, str]) -> set[str]:
    names: set[str] = set()
    i = 0
    while i < len(tokens):
        word = tokens[i].rsplit("/", 1)[-1]
        i += 1
        if word not in COMMANDS:
            continue
        value_options = GROUPADD_VALUE_OPTIONS if word == "groupadd" else VALUE_OPTIONS
        while i < len(tokens) and tokens[i] not in SEPARATORS:
            token = tokens[i]
            i += 1
            if token in (">", "<", ">>", ">&", "2>", "&>"):
                i += 1  # a redirection's target
                continue
            if token.startswith("-"):
                option, _, inline = token.partition("=")
                if option in GROUP_OPTIONS:
                    value = inline or (tokens[i] if i < len(tokens) else "")
                    if not inline:
                        i += 1
                    for group in value.split(","):
                        names |= _resolve(group, variables)
                elif option in value_options and not inline:
                    i += 1
                continue
            if token.isdigit() or token.startswith(("2>", "1>", ">")):
                continue
            names |= _resolve(token, variables)
    return names


def _resolve(token: str, variables: dict[str, str]) -> set[str]:
    match = VARIABLE_RE.match(token)
    if match:
        token = variables.get(match.group(1), "")
    return {token} if NAME_RE.fullmatch(token) else set()


def names_from_sysusers(text: str) -> set[str]:
    """User and group names of a sysusers.d file: ``u`` and ``g`` lines, and both
    names of an ``m`` (membership) line."""
    names: set[str] = set()
    for line in text.splitlines():
        try:
            fields = shlex.split(line, comments=True)
        except ValueError:
            continue
        if len(fields) < 2 or fields[0].rstrip("!") not in ("u", "g", "m"):
            continue
        candidates = [fields[1]] + (fields[2:3] if fields[0] == "m" else [])
        names |= {n for n in candidates if NAME_RE.fullmatch(n)}
    return names


def names_from_master_file(text: str) -> set[str]:
    """The first field of each line of base-passwd's passwd.master or group.master."""
    return {line.split(":", 1)[0] for line in text.splitlines() if ":" in line}


def read_package_list(path: Path = PACKAGES_FILE) -> list[str]:
    packages = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            packages.append(line)
    return packages


class Apt:
    """apt-get with a configuration of its own under ``root``: its own sources list,
    package lists and cache, so the machine's apt setup is left alone."""

    def __init__(self, root: Path, suites: tuple[str, ...], mirror: str = MIRROR):
        self.root = root
        (root / "lists" / "partial").mkdir(parents=True)
        (root / "cache" / "archives" / "partial").mkdir(parents=True)
        (root / "status").write_text("")
        (root / "sources.list").write_text(
            "".join(f"deb {mirror} {suite} main\n" for suite in suites)
        )

    def _options(self) -> list[str]:
        return [
            "-q", "-o", f"Dir::Etc::SourceList={self.root / 'sources.list'}",
            "-o", "Dir::Etc::SourceParts=/nonexistent",
            "-o", f"Dir::State::Lists={self.root / 'lists'}",
            "-o", f"Dir::Cache={self.root / 'cache'}",
            "-o", f"Dir::State::status={self.root / 'status'}",
            "-o", "APT::Architecture=amd64", "-o", "Acquire::Languages=none",
        ]  # fmt: skip

    def update(self) -> None:
        subprocess.run(["apt-get", *self._options(), "update"], check=True, capture_output=True)

    def _show(self, packages: list[str], *, strict: bool = True) -> dict[str, dict[str, str]]:
        """apt-cache's record of each package's candidate version, by name. Not strict:
        names without one (virtual packages) are left out."""
        done = subprocess.run(
            ["apt-cache", *self._options(), "show", "--no-all-versions", *packages],
            capture_output=True, text=True,
        )  # fmt: skip
        if strict and done.returncode != 0:
            raise SystemExit(f"reserved-names: apt-cache show failed: {done.stderr.strip()}")
        records = {}
        for block in done.stdout.split("\n\n"):
            fields = dict(re.findall(r"^([A-Za-z-]+): (.*)$", block, re.M))
            if "Package" in fields:
                records[fields["Package"]] = fields
        return records

    def with_siblings(self, packages: list[str]) -> list[str]:
        """``packages`` and what they depend on, directly or not, built from the same
        source."""

        def source(record: dict[str, str]) -> str:
            return record.get("Source", record["Package"]).split()[0]

        result = set(packages)
        todo = list(self._show(packages).values())
        while todo:
            wanted: dict[str, set[str]] = defaultdict(set)
            for record in todo:
                for field in ("Pre-Depends", "Depends"):
                    for dep in re.split(r"[,|]", record.get(field, "")):
                        dep = dep.split("(")[0].split(":")[0].strip()
                        if dep and dep not in result:
                            wanted[dep].add(source(record))
            shown = self._show(sorted(wanted), strict=False) if wanted else {}
            todo = [r for name, r in shown.items() if source(r) in wanted[name]]
            result |= {r["Package"] for r in todo}
        return sorted(result)

    def download(self, packages: list[str], into: Path) -> dict[str, Path]:
        """Each package's .deb (the newest version in the suites), by package name."""
        done = subprocess.run(
            ["apt-get", *self._options(), "download", *packages],
            capture_output=True, text=True, cwd=into,
        )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"reserved-names: apt-get download failed: {done.stderr.strip()}")
        debs = {deb.name.split("_", 1)[0]: deb for deb in into.glob("*.deb")}
        missing = [p for p in packages if p not in debs]
        if missing:
            raise SystemExit(f"reserved-names: not downloaded: {' '.join(missing)}")
        return debs


def names_in_deb(deb: Path, work: Path) -> set[str]:
    """Every account name that one package's data says it makes (see the module doc)."""
    control = work / deb.stem
    subprocess.run(["dpkg-deb", "-e", str(deb), str(control)], check=True)
    names: set[str] = set()
    for script in ("preinst", "postinst", "config"):
        path = control / script
        if path.is_file():
            names |= names_from_maintainer_script(path.read_text(errors="replace"))
    listing = subprocess.run(
        ["dpkg-deb", "--fsys-tarfile", str(deb)], check=True, capture_output=True
    ).stdout
    members = (
        subprocess.run(["tar", "-t"], input=listing, check=True, capture_output=True)
        .stdout.decode(errors="replace")
        .splitlines()
    )
    wanted = [m for m in members if "/sysusers.d/" in m and m.endswith(".conf")]
    wanted += [m for m in members if m.endswith(("/passwd.master", "/group.master"))]
    for member in wanted:
        text = subprocess.run(
            ["tar", "-xO", member], input=listing, check=True, capture_output=True
        ).stdout.decode(errors="replace")
        if member.endswith(".master"):
            names |= names_from_master_file(text)
        else:
            names |= names_from_sysusers(text)
    return names


def render(found: dict[str, set[str]], suites: tuple[str, ...], packages: list[str]) -> str:
    today = datetime.date.today().isoformat()
    header = [
        "# User and group names that Debian packages create: a portal username may not be",
        "# one of them (every portal user gets a user and a group of that name on the",
        "# workers). Generated by bin/reserved-names (accounts/reserved_names.py); do not",
        "# edit, run it again. Made on "
        + today
        + f" from Debian {' + '.join(suites)} (main, amd64):",
        "# base-passwd's passwd.master and group.master, and the sysusers.d files and",
        "# the adduser/addgroup/useradd/groupadd commands of the maintainer scripts",
        f"# (preinst, postinst, config) of the {len(packages)} packages listed in",
        "# accounts/data/reserved-packages.txt.",
        "# <name><TAB><packages that create or use it>",
    ]
    lines = [f"{name}\t{','.join(sorted(found[name]))}" for name in sorted(found)]
    return "\n".join(header + lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bin/reserved-names", description=__doc__.split("\n")[0])
    parser.add_argument("--suite", action="append", help="Debian suite (repeatable)")
    parser.add_argument("--output", type=Path, default=OUTPUT_FILE)
    args = parser.parse_args(argv)
    suites = tuple(args.suite or DEFAULT_SUITES)
    packages = read_package_list()
    found: dict[str, set[str]] = defaultdict(set)
    with tempfile.TemporaryDirectory(prefix="reserved-names.") as tmp:
        root = Path(tmp)
        apt = Apt(root / "apt", suites)
        apt.update()
        (root / "debs").mkdir()
        (root / "work").mkdir()
        debs = apt.download(apt.with_siblings(packages), root / "debs")
        for package, deb in sorted(debs.items()):
            for name in names_in_deb(deb, root / "work"):
                found[name].add(package)
    args.output.write_text(render(found, suites, packages))
    print(f"{len(found)} names from {len(packages)} packages -> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
