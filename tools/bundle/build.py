"""`make bundle`: the offline install bundle, build/bundle/xdp-agg-bundle-<version>.tar.

Run on a Debian 12 (bookworm, amd64) machine that reaches Debian's archive and PyPI. The bundle
holds everything an air-gapped aggregator or worker box needs beside its own Python 3
(docs/install-offline.md):

- debs/: Debian 12's libbpf1 (what loads the BPF objects), iproute2 (ip, tc), nftables, ethtool
  and procps, with their dependency closure minus what every target has already (the base, see
  `base_packages`), fetched with `apt-get download`. No compiler, LLVM or kernel headers: the
  BPF objects are built here (`make bpf`) and ship in the project's wheel and sdist.
- wheels/: for each target Python (TARGETS: 3.11 for Debian 12, 3.12 for Ubuntu 24.04) the
  binary wheels of the project's dependencies (`pip download --only-binary` with
  --python-version and --platform), pip, and setuptools (to build the sdist on a target that
  has no project wheel); the project's own wheel for every target Python this machine has
  (--python, repeatable: a wheel holds the C fast path, built for one CPython).
- sdist/: the project's sdist, every project wheel built from it.
- install.py (tools/bundle/install.py, run by the target's python3), manifest.json, README.md.

Nothing is installed on this machine. The resolver (`resolve`) reads `apt-cache dumpavail`: one
record per package, the candidate version.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
# What a box needs from Debian: libbpf.so.1 (libbpf1: the loader's ctypes binding), ip and tc
# (iproute2), nft, ethtool, and sysctl (procps: the testbed; a minimal Debian lacks it). The
# testbed's nsenter is util-linux's, which every target has.
ROOTS = ("libbpf1", "iproute2", "nftables", "ethtool", "procps")
# The target's own Python: neither it nor what it depends on goes into the bundle.
TARGET_HAS = ("python3",)
# Executables the bundle offers where the target lacks them: name -> package.
TOOLS = {
    "ip": "iproute2",
    "tc": "iproute2",
    "nft": "nftables",
    "ethtool": "ethtool",
    "sysctl": "procps",
}
TARGETS = {
    "cp311": {"python": "3.11", "dist": "Debian 12"},
    "cp312": {"python": "3.12", "dist": "Ubuntu 24.04"},
}
# glibc 2.36 (Debian 12; Ubuntu 24.04 has 2.39): the newest manylinux tag the wheels may need.
GLIBC_MAX = 36
DEFAULT_EXTRAS = ("metrics",)
# What the smoke test imports in the venv (from the wheels).
SMOKE_IMPORTS = [
    "numpy",
    "pyroute2",
    "scapy",
    "click",
    "hostlib",
    "xdp_switch",
    "xdp_agg.app",
]


# --- Debian's package records and the closure -----------------------------------------------


def parse_records(text: str) -> dict[str, dict[str, str]]:
    """Package name -> its fields, from deb822 stanzas (apt-cache dumpavail, a Packages file)."""
    out: dict[str, dict[str, str]] = {}
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        key = None
        for line in stanza.splitlines():
            if line[:1] in (" ", "\t") and key:
                fields[key] += "\n" + line.strip()
            elif ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if "Package" in fields:
            out[fields["Package"]] = fields
    return out


def parse_depends(value: str) -> list[list[str]]:
    """'a (>= 1) | b, c:any' -> [['a', 'b'], ['c']]: names only, versions and arch dropped."""
    groups = []
    for group in filter(None, (g.strip() for g in value.split(","))):
        names = [re.split(r"[\s(:\[]", alt.strip(), maxsplit=1)[0] for alt in group.split("|")]
        groups.append([n for n in names if n])
    return groups


def _deps(record: dict[str, str]) -> list[list[str]]:
    return parse_depends(record.get("Pre-Depends", "")) + parse_depends(record.get("Depends", ""))


def _providers(records: dict[str, dict[str, str]]) -> dict[str, list[str]]:
    """Virtual package -> the packages that provide it, in name order."""
    prov: dict[str, list[str]] = {}
    for name in sorted(records):
        for group in parse_depends(records[name].get("Provides", "")):
            for virtual in group:
                prov.setdefault(virtual, []).append(name)
    return prov


def closure(records, roots, have=frozenset()) -> list[str]:
    """The packages `roots` need, in the order found, without those in `have` and without
    following them. Of alternatives ('a | b'), one already chosen or in `have` satisfies the
    group, else the first that exists; a virtual package is satisfied by any provider."""
    prov = _providers(records)
    chosen: list[str] = []
    seen = set(have)

    def satisfied(name: str) -> bool:
        return name in seen or any(p in seen for p in prov.get(name, ()))

    def pick(group: list[str]) -> str | None:
        for name in group:
            if name in records:
                return name
            if prov.get(name):
                return prov[name][0]
        return None

    todo = [[r] for r in roots]
    while todo:
        group = todo.pop(0)
        if any(satisfied(n) for n in group):
            continue
        name = pick(group)
        if name is None:
            raise SystemExit(f"no package satisfies {' | '.join(group)}")
        seen.add(name)
        chosen.append(name)
        todo.extend(_deps(records[name]))
    return chosen


def base_packages(records) -> set[str]:
    """What every target has: a minimal Debian 12 (the Essential and Priority: required
    packages and their closure, what `debootstrap --variant=minbase` installs; Ubuntu 24.04 has
    the same libraries, some under t64 names) and the target's Python (TARGET_HAS and its
    closure: the target runs its own python3). install.py checks each library again on the
    target and registers only those the target lacks."""
    required = [
        n
        for n, r in records.items()
        if r.get("Essential") == "yes" or r.get("Priority") == "required"
    ]
    return set(closure(records, sorted(required))) | set(closure(records, TARGET_HAS))


# --- fetching ----------------------------------------------------------------------------------


def run(argv, **kw) -> subprocess.CompletedProcess:
    """Run argv, echoing it; stop the build with its output when it fails."""
    print("+", " ".join(map(str, argv)), flush=True)
    cp = subprocess.run(list(map(str, argv)), capture_output=True, text=True, **kw)
    if cp.returncode != 0:
        sys.exit(f"failed ({cp.returncode}): {cp.stdout[-3000:]}{cp.stderr[-3000:]}")
    return cp


def fetch_debs(records, names: list[str], dest: Path) -> list[dict]:
    """apt-get download of each package's candidate version into dest."""
    dest.mkdir(parents=True)
    run(["apt-get", "download", *(f"{n}={records[n]['Version']}" for n in names)], cwd=dest)
    found = {}
    for file in sorted(dest.glob("*.deb")):
        fields = run(["dpkg-deb", "-f", file, "Package", "Version"]).stdout
        found[parse_records(fields)[file.name.split("_")[0]]["Package"]] = file.name
    return [{"package": n, "version": records[n]["Version"], "file": found[n]} for n in names]


def platforms(glibc_max: int = GLIBC_MAX) -> list[str]:
    """The manylinux tags a target with glibc 2.<glibc_max> on x86-64 accepts."""
    tags = [f"manylinux_2_{m}_x86_64" for m in range(glibc_max, 16, -1)]
    return tags + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def requirements(extras=DEFAULT_EXTRAS) -> list[str]:
    """The project's dependencies and those of `extras` (pyproject.toml), with pip and the
    setuptools that builds the sdist."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    backend = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    return reqs + backend + ["pip"]


def fetch_wheels(tag: str, reqs: list[str], dest: Path, work: Path) -> list[str]:
    """pip download of binary wheels for target `tag` (cp311, ...) into dest; their names."""
    tmp = work / f"wheels-{tag}"
    argv = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--no-cache-dir"]
    argv += ["--python-version", TARGETS[tag]["python"], "--implementation", "cp", "--abi", tag]
    for p in platforms():
        argv += ["--platform", p]
    run([*argv, "-d", tmp, *reqs])
    return _move_wheels(tmp, dest)


def _move_wheels(src: Path, dest: Path) -> list[str]:
    dest.mkdir(parents=True, exist_ok=True)
    names = sorted(p.name for p in src.glob("*.whl"))
    for n in names:
        if not (dest / n).exists():
            shutil.move(src / n, dest / n)
    shutil.rmtree(src)
    return names


def python_tag(python: str) -> str | None:
    """'cp311' for a CPython 3.11 interpreter; None for one that does not run (a pyenv shim
    of a version not selected)."""
    argv = [python, "-c", "import sys; print('cp%d%d' % sys.version_info[:2])"]
    cp = subprocess.run(argv, capture_output=True, text=True)
    return cp.stdout.strip() if cp.returncode == 0 else None


def build_project(pythons: list[str], stage: Path, work: Path) -> tuple[str, dict[str, str]]:
    """The sdist (built here with this Python's `build`), and from it a wheel with every
    interpreter in `pythons` whose version is a target's: (sdist name, {tag: wheel name})."""
    run([sys.executable, "-m", "build", "--sdist", "--outdir", stage / "sdist", ROOT])
    (sdist,) = (stage / "sdist").glob("xdp_agg-*.tar.gz")
    wheels = {}
    for py in pythons:
        tag = python_tag(py)
        if tag not in TARGETS or tag in wheels:
            print(f"  {py}: {tag or 'does not run'}: no target's Python, or has its wheel")
            continue
        out = work / f"project-{tag}"
        run([py, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w", out, sdist])
        (wheel,) = _move_wheels(out, stage / "wheels")
        wheels[tag] = wheel
    return sdist.name, wheels


# --- the bundle --------------------------------------------------------------------------------


def os_release(path: Path = Path("/etc/os-release")) -> dict[str, str]:
    """KEY=VALUE lines of os-release, quotes dropped."""
    out = {}
    for line in path.read_text().splitlines():
        k, sep, v = line.partition("=")
        if sep:
            out[k.strip()] = v.strip().strip('"')
    return out


def git_commit() -> str:
    cp = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True)
    return cp.stdout.decode().strip() or "unknown"


def resolve_debs(records) -> tuple[list[str], list[str]]:
    """(runtime packages, the base left out)."""
    base = base_packages(records)
    runtime = closure(records, ROOTS, have=frozenset(base))
    return runtime, sorted(base & _mentioned(records, runtime))


def _mentioned(records, names) -> set[str]:
    """Every package named in the Depends of `names` (for the manifest's list of what the
    target is expected to have)."""
    return {n for name in names for g in _deps(records[name]) for n in g}


def write_tar(stage: Path, out: Path) -> None:
    """stage as one uncompressed tar (its debs and wheels are compressed already)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tar.part")
    with tarfile.open(tmp, "w") as tar:
        tar.add(stage, arcname=stage.name)
    tmp.replace(out)


def build(args) -> Path:
    """Stage everything in build/bundle/<name>/ and tar it; returns the tar's path."""
    t0 = time.monotonic()
    rel = os_release()
    if rel.get("VERSION_CODENAME") != "bookworm" and not args.any_distribution:
        sys.exit("the bundle carries Debian 12's packages: build it on Debian 12 (bookworm)")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    name = f"xdp-agg-bundle-{version}"
    outdir = Path(args.outdir)
    stage, work = outdir / name, outdir / "work"
    for d in (stage, work):
        shutil.rmtree(d, ignore_errors=True)
    work.mkdir(parents=True)
    records = parse_records(run(["apt-cache", "dumpavail"]).stdout)
    runtime, base = resolve_debs(records)
    debs = fetch_debs(records, runtime, stage / "debs")
    for d in debs:
        d["role"] = "runtime"
    reqs = requirements(args.extra)
    targets = {}
    for tag, t in TARGETS.items():
        targets[tag] = dict(t, wheels=fetch_wheels(tag, reqs, stage / "wheels", work))
    sdist, project_wheels = build_project(args.python, stage, work)
    for tag, t in targets.items():
        t["project_wheel"] = project_wheels.get(tag)
    shutil.copy2(HERE / "install.py", stage / "install.py")
    shutil.copy2(ROOT / "docs" / "install-offline.md", stage / "README.md")
    manifest = {
        "name": name,
        "version": version,
        "commit": git_commit(),
        "built_on": rel.get("PRETTY_NAME", "?"),
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "arch": "amd64",
        "debs": debs,
        "base_left_out": base,
        "tools": TOOLS,
        "commands": ["xdp-agg", "netns-testbed"],
        "smoke_imports": SMOKE_IMPORTS,
        "extras": list(args.extra),
        "sdist": sdist,
        "targets": targets,
    }
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.rmtree(work)
    out = outdir / f"{name}.tar"
    write_tar(stage, out)
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB in {time.monotonic() - t0:.0f} s")
    for tag, t in targets.items():
        have = t["project_wheel"] or "none (the target builds the sdist: needs cc, Python.h)"
        print(f"  {tag} ({t['dist']}): {len(t['wheels'])} wheels, project wheel {have}")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--outdir", default=str(ROOT / "build" / "bundle"))
    p.add_argument(
        "--python",
        action="append",
        default=None,
        help="another interpreter to build the project's wheel with, beside this one "
        "(repeatable); default: python3.11 and python3.12 on PATH",
    )
    p.add_argument("--extra", action="append", default=None, help="extras to carry (metrics)")
    p.add_argument("--any-distribution", action="store_true", help="build off Debian 12 anyway")
    args = p.parse_args(argv)
    if args.python is None:
        args.python = [shutil.which(f"python{t['python']}") for t in TARGETS.values()]
    args.python = [sys.executable, *filter(None, args.python)]
    args.extra = tuple(args.extra or DEFAULT_EXTRAS)
    os.umask(0o022)
    build(args)


if __name__ == "__main__":
    main()
