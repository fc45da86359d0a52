"""Install the xdp-agg offline bundle into a prefix of its own, with no network.

Run from the unpacked bundle with the system's python3, as root:

    tar xf xdp-agg-bundle-0.1.0.tar && cd xdp-agg-bundle-0.1.0
    python3 install.py --prefix /opt/xdp-agg

It unpacks the bundle's Debian packages with `dpkg -x` into PREFIX/root (never `dpkg -i`: the
system's packages stay as they are), links the libraries the system lacks, and only those, into
PREFIX/lib/ld and registers that directory with ld.so (an /etc/ld.so.conf.d file), makes a venv
from this python3 with the system's site packages, installs the wheels with --no-index (the
project's carries its BPF objects, built where the bundle was: no compiler here), writes wrappers
in PREFIX/bin, and ends with a smoke test. PREFIX/uninstall.sh undoes it all.
docs/install-offline.md (README.md in the bundle) says why each step is done the way it is.
Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARKER = ".xdp-agg-bundle"
KNOWN = {("debian", "12"): "cp311", ("ubuntu", "24.04"): "cp312"}
SBIN = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
T0 = time.monotonic()


class InstallError(Exception):
    """What stopped the install, in words for the operator."""


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def run(argv, env=None, check=True, **kw) -> subprocess.CompletedProcess:
    cp = subprocess.run(list(map(str, argv)), capture_output=True, text=True, env=env, **kw)
    if check and cp.returncode != 0:
        raise InstallError(
            f"{' '.join(map(str, argv))} failed ({cp.returncode}):\n"
            f"{cp.stdout[-3000:]}{cp.stderr[-3000:]}"
        )
    return cp


# --- what the target is -----------------------------------------------------------------------


def parse_os_release(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        k, sep, v = line.partition("=")
        if sep:
            out[k.strip()] = v.strip().strip("\"'")
    return out


def pick_target(manifest: dict, release: dict[str, str], version: tuple[int, int]):
    """(tag, note): the bundle's target for this Python (cp311, cp312), and a note where the
    distribution is not the one the target was made for. InstallError if the bundle has no
    wheels for this Python."""
    tag = f"cp{version[0]}{version[1]}"
    dist = (release.get("ID", "?"), release.get("VERSION_ID", "?"))
    if tag not in manifest["targets"]:
        have = ", ".join(
            f"Python {t['python']} ({t['dist']})" for t in manifest["targets"].values()
        )
        raise InstallError(
            f"this bundle has wheels for {have}, not for Python "
            f"{version[0]}.{version[1]}: run install.py with one of those"
        )
    note = ""
    if KNOWN.get(dist) != tag:
        note = (
            f"{release.get('PRETTY_NAME', dist)} with Python {version[0]}.{version[1]} is not "
            f"a tested target ({manifest['targets'][tag]['dist']} is): going on"
        )
    return tag, note


# --- unpacking and libraries ------------------------------------------------------------------


def unpack(bundle: Path, manifest: dict, root: Path) -> None:
    """dpkg -x every deb of the bundle into root."""
    root.mkdir(parents=True, exist_ok=True)
    for d in manifest["debs"]:
        run(["dpkg", "-x", bundle / "debs" / d["file"], root])


def elf_soname(path: Path) -> str | None:
    """DT_SONAME of a 64-bit little-endian ELF shared object, or None (not ELF, no soname)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if data[:6] != b"\x7fELF\x02\x01" or struct.unpack_from("<H", data, 16)[0] != 3:
        return None  # not ELF64 LE, or not ET_DYN
    (phoff,) = struct.unpack_from("<Q", data, 32)
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    loads, dyn = [], None
    for i in range(phnum):
        p_type, _, off, vaddr, _, filesz, _, _ = struct.unpack_from(
            "<IIQQQQQQ", data, phoff + i * phentsize
        )
        if p_type == 1:
            loads.append((vaddr, off, filesz))
        elif p_type == 2:
            dyn = (off, filesz)
    if dyn is None:
        return None
    tags = {}
    for i in range(dyn[1] // 16):
        tag, val = struct.unpack_from("<qQ", data, dyn[0] + 16 * i)
        if tag == 0:
            break
        tags.setdefault(tag, val)
    if 14 not in tags or 5 not in tags:  # DT_SONAME, DT_STRTAB
        return None
    for vaddr, off, filesz in loads:
        if vaddr <= tags[5] < vaddr + filesz:
            start = tags[5] - vaddr + off + tags[14]
            return data[start : data.index(b"\0", start)].decode()
    return None


def bundle_libs(root: Path) -> dict[str, Path]:
    """soname -> the real file, for every shared library under root's lib directories."""
    out: dict[str, Path] = {}
    for top in ("lib", "usr/lib"):
        for dirpath, dirnames, files in os.walk(root / top):
            dirnames[:] = sorted(d for d in dirnames if d != "python3")
            for f in sorted(files):
                p = Path(dirpath) / f
                if ".so" in f and not p.is_symlink():
                    name = elf_soname(p)
                    if name and (name not in out or "-linux-gnu" in str(p)):
                        out[name] = p
    return out


def system_sonames(ldconfig_p: str, ignore: Path | None = None) -> set[str]:
    """The x86-64 sonames in ld.so's cache (`ldconfig -p`), less those under `ignore` (an
    earlier install's links)."""
    out = set()
    for line in ldconfig_p.splitlines():
        m = re.match(r"\s+(\S+) \(([^)]*)\) => (\S+)", line)
        if m and "x86-64" in m.group(2):
            if ignore is None or not m.group(3).startswith(str(ignore) + "/"):
                out.add(m.group(1))
    return out


def ldconfig() -> str:
    return shutil.which("ldconfig", path=os.pathsep.join(SBIN)) or "ldconfig"


def link_missing(libs: dict[str, Path], system: set[str], linkdir: Path) -> list[str]:
    """Links named by soname in linkdir to each library the system lacks; their sonames."""
    linkdir.mkdir(parents=True, exist_ok=True)
    missing = sorted(set(libs) - system)
    for name in missing:
        (linkdir / name).symlink_to(libs[name])
    return missing


def conf_name(prefix: Path) -> str:
    """The ld.so.conf.d file of an install in prefix (one per prefix)."""
    return "xdp-agg" + re.sub(r"[^A-Za-z0-9]+", "-", str(prefix)).rstrip("-") + ".conf"


def register(linkdir: Path, conf: Path) -> None:
    """ld.so searches linkdir from now on (it holds only sonames the system lacks)."""
    conf.write_text(f"# xdp-agg offline bundle: libraries this system lacks\n{linkdir}\n")
    run([ldconfig()])


# --- the venv, wrappers -----------------------------------------------------------------


def make_venv(python: str, prefix: Path) -> Path:
    """A venv from `python` with its system site packages (pip comes from the bundle: Debian's
    and Ubuntu's python3 lack ensurepip without python3-venv)."""
    venv = prefix / "venv"
    run([python, "-m", "venv", "--without-pip", "--system-site-packages", venv])
    return venv / "bin" / "python"


def can_build_sdist(python: str) -> str:
    """'' if this Python can compile the project's C extension, else what it lacks."""
    inc = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"]).stdout
    lacks = [
        w
        for w, ok in (
            ("a C compiler (cc)", shutil.which("cc")),
            ("Python.h (python3-dev)", Path(inc.strip(), "Python.h").exists()),
        )
        if not ok
    ]
    return " and ".join(lacks)


def pip_install(bundle: Path, manifest: dict, tag: str, vpy: Path) -> None:
    """pip (from its wheel) and the project with its extras, from the bundle alone."""
    wheels = bundle / "wheels"
    target = manifest["targets"][tag]
    (pip,) = [w for w in target["wheels"] if w.startswith("pip-")]
    project = target.get("project_wheel")
    if project:
        spec = str(wheels / project)
    else:
        lacks = can_build_sdist(str(vpy))
        if lacks:
            raise InstallError(
                f"the bundle has no xdp-agg wheel for {tag} and this machine lacks {lacks} to "
                f"build its sdist: build the bundle where python{target['python']} is "
                "(make bundle BUNDLE_PYTHONS=...), or install those"
            )
        say(f"no xdp-agg wheel for {tag}: building the sdist here")
        spec = str(bundle / "sdist" / manifest["sdist"])
    extras = ",".join(manifest.get("extras", []))
    env = dict(
        os.environ,
        PIP_NO_INDEX="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
        PIP_CONFIG_FILE=os.devnull,
    )
    run(
        [
            vpy,
            wheels / pip / "pip",
            "install",
            "--no-index",
            "--no-cache-dir",
            "--find-links",
            wheels,
            "--quiet",
            "pip",
            f"xdp-agg[{extras}] @ file://{spec}" if extras else spec,
        ],
        env=env,
    )


def wrapper(path: Path, exe: Path, prefix: Path, ld_env: bool, extra: str = "") -> None:
    """A shell wrapper that runs exe with PREFIX/bin first on PATH (and, in env mode, the
    missing libraries on LD_LIBRARY_PATH)."""
    lines = [
        "#!/bin/sh",
        "# xdp-agg offline bundle (install.py)",
        f'PATH="{prefix}/bin:$PATH"; export PATH',
    ]
    if ld_env:
        lines.append(
            f'LD_LIBRARY_PATH="{prefix}/lib/ld${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"; '
            "export LD_LIBRARY_PATH"
        )
    lines += [extra] if extra else []
    lines.append(f'exec "{exe}" "$@"')
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)


def find_tool(root: Path, name: str) -> Path | None:
    for d in ("bin", "sbin", "usr/bin", "usr/sbin"):
        if (root / d / name).is_file():
            return root / d / name
    return None


def write_wrappers(prefix: Path, root: Path, manifest: dict, ld_env: bool) -> list[str]:
    """PREFIX/bin: the project's commands and python, and each tool the system lacks."""
    bindir = prefix / "bin"
    bindir.mkdir(exist_ok=True)
    venv_bin = prefix / "venv" / "bin"
    made = []
    for cmd in manifest.get("commands", ["xdp-agg", "netns-testbed"]):
        if (venv_bin / cmd).exists():
            wrapper(bindir / cmd, venv_bin / cmd, prefix, ld_env)
            made.append(cmd)
    wrapper(bindir / "xdp-agg-python", venv_bin / "python", prefix, ld_env)
    system_path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    for tool in manifest["tools"]:
        exe = find_tool(root, tool)
        if exe and not shutil.which(tool, path=system_path):
            tc_lib = root / "usr" / "lib" / "tc"
            extra = f'TC_LIB_DIR="{tc_lib}"; export TC_LIB_DIR' if tc_lib.is_dir() else ""
            wrapper(bindir / tool, exe, prefix, ld_env, extra if tool == "tc" else "")
            made.append(tool)
    return made


def write_uninstall(prefix: Path, conf: Path | None):
    """PREFIX/uninstall.sh: the ld.so.conf.d file, then PREFIX."""
    lines = ["#!/bin/sh", "# undoes install.py", "set -e"]
    if conf:
        lines.append(f'rm -f "{conf}" && "{ldconfig()}"')
    lines.append(f'rm -rf "{prefix}"')
    (prefix / "uninstall.sh").write_text("\n".join(lines) + "\n")
    (prefix / "uninstall.sh").chmod(0o755)


# --- the smoke test ----------------------------------------------------------------------------

IMPORTS = """
import importlib, sys, warnings
warnings.simplefilter("ignore")
for name in sys.argv[1:]:
    m = importlib.import_module(name)
    print(f"import {name}: {getattr(m, '__version__', '')} {m.__file__}")
"""
BPF_CHECK = """
import time
from xdp_switch import loader
t = time.monotonic()
ld = loader.load()
dt = time.monotonic() - t
print(f"{ld.path.name}: libbpf loaded it, the verifier accepted "
      f"{', '.join(sorted(ld.progs))} ({dt:.1f} s)")
ld.close()
from hostlib import native_stream
print(f"hostlib C loop (hostlib._fastpath): {'built' if native_stream.available() else 'MISSING'}")
"""


def unresolved(files, env) -> list[str]:
    """`ldd` lines of files that name a library ld.so cannot find or a missing symbol version."""
    bad = []
    for f in files:
        cp = run(["ldd", f], env=env, check=False)
        bad += [
            f"{f}: {ln.strip()}" for ln in (cp.stdout + cp.stderr).splitlines() if "not found" in ln
        ]
    return bad


def smoke(
    prefix: Path, root: Path, manifest: dict, linked: list[Path], wrapped: list[str], opts
) -> None:
    """Every library and tool resolves, the commands start, the modules import, and (as root)
    libbpf loads the shipped program and the verifier accepts it; optionally the
    micro-benchmark."""
    env = dict(os.environ)
    if opts.ld_mode == "env":
        env["LD_LIBRARY_PATH"] = str(prefix / "lib" / "ld")
    tools = [find_tool(root, t) for t in wrapped if t in manifest["tools"]]
    bad = unresolved([*linked, *tools], env)
    if bad:
        raise InstallError("unresolved libraries:\n  " + "\n  ".join(bad))
    say(f"smoke: ldd finds every library of {len(linked)} linked libraries and {len(tools)} tools")
    bin_ = prefix / "bin"
    checks = [[bin_ / "xdp-agg", "--version"]] if (bin_ / "xdp-agg").exists() else []
    checks.append([bin_ / "xdp-agg-python", "-c", IMPORTS, *manifest.get("smoke_imports", [])])
    versions = {"ip": "-V", "tc": "-V", "nft": "--version", "ethtool": "--version"}
    for t in manifest["tools"]:
        exe = bin_ / t if t in wrapped else shutil.which(t, path=os.pathsep.join(SBIN))
        if exe:
            checks.append([exe, versions.get(t, "--version")])
    if opts.bpf:
        checks.append([bin_ / "xdp-agg-python", "-c", BPF_CHECK])
    if opts.bench:
        checks.append([bin_ / "xdp-agg", "bench", "--repeats", "1", "--rounds", "5"])
    for argv in checks:
        cp = run(argv, timeout=600)
        shown = argv[0] if "-c" not in argv else f"{argv[0]} -c ..."
        say(f"smoke: {shown} {' '.join(map(str, argv[1:2])) if '-c' not in argv else ''}")
        for line in (cp.stdout + cp.stderr).strip("\n").splitlines():
            print(f"    {line}")


# --- the whole install ------------------------------------------------------------------------


def prepare(prefix: Path) -> None:
    """An empty prefix: a new one, or an earlier install's (its marker says so) wiped."""
    if prefix.exists() and any(prefix.iterdir()):
        if not (prefix / MARKER).exists():
            raise InstallError(f"{prefix} is not empty and holds no earlier install: pick another")
        shutil.rmtree(prefix)
    prefix.mkdir(parents=True, exist_ok=True)
    (prefix / MARKER).write_text("xdp-agg offline bundle install: uninstall.sh removes it\n")


def install(opts) -> None:
    bundle = Path(opts.bundle).resolve()
    manifest = json.loads((bundle / "manifest.json").read_text())
    release = parse_os_release(Path(opts.os_release).read_text())
    pyver = run([opts.python, "-c", "import sys; print('%d %d' % sys.version_info[:2])"]).stdout
    tag, note = pick_target(manifest, release, tuple(map(int, pyver.split())))
    say(
        f"{manifest['name']} ({manifest['commit']}) for {tag}, {release.get('PRETTY_NAME', '?')}, "
        f"into {opts.prefix} (libraries: {opts.ld_mode})"
    )
    if note:
        say(note)
    prefix = Path(opts.prefix).resolve()
    prepare(prefix)
    root = prefix / "root"
    unpack(bundle, manifest, root)
    say(f"unpacked {len(manifest['debs'])} debs into {root}")
    libs = bundle_libs(root)
    linkdir = prefix / "lib" / "ld"
    ld_p = run([ldconfig(), "-p"]).stdout
    missing = link_missing(libs, system_sonames(ld_p, ignore=linkdir), linkdir)
    say(
        f"{len(missing)} of {len(libs)} libraries are missing here, linked in {linkdir}: "
        f"{' '.join(missing) or 'none'}"
    )
    conf = None
    if opts.ld_mode == "ldconfig":
        conf = Path(opts.ldconf_dir) / conf_name(prefix)
        register(linkdir, conf)
        say(f"registered with ld.so: {conf}")
    vpy = make_venv(opts.python, prefix)
    pip_install(bundle, manifest, tag, vpy)
    say(f"venv {prefix / 'venv'}: installed xdp-agg and its wheels with --no-index")
    wrapped = write_wrappers(prefix, root, manifest, opts.ld_mode == "env")
    write_uninstall(prefix, conf)
    say(f"wrappers in {prefix / 'bin'}: {' '.join(wrapped)} xdp-agg-python")
    if opts.smoke:
        smoke(prefix, root, manifest, [linkdir / m for m in missing], wrapped, opts)
    say(
        f"installed; {prefix / 'bin'} on PATH, or {prefix / 'bin' / 'xdp-agg'}; "
        f"{prefix / 'uninstall.sh'} removes it"
    )


def parse_args(argv=None):
    root = os.geteuid() == 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix", required=True, help="where to install (its own directory)")
    p.add_argument(
        "--ld-mode",
        choices=("ldconfig", "env"),
        default="ldconfig" if root else "env",
        help="ldconfig: an ld.so.conf.d file (root, the default); env: "
        "LD_LIBRARY_PATH in PREFIX/bin's wrappers only",
    )
    p.add_argument("--python", default=sys.executable, help="the Python of the venv")
    p.add_argument("--no-smoke", dest="smoke", action="store_false", help="skip the smoke test")
    p.add_argument(
        "--no-bpf",
        dest="bpf",
        action="store_false",
        default=root,
        help="smoke test without loading BPF (the default when not root)",
    )
    p.add_argument("--bench", action="store_true", help="end with a short `xdp-agg bench`")
    for name, default in (
        ("bundle", str(HERE)),
        ("ldconf-dir", "/etc/ld.so.conf.d"),
        ("os-release", "/etc/os-release"),
    ):
        p.add_argument(f"--{name}", default=default, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    opts = parse_args(argv)
    try:
        install(opts)
    except InstallError as e:
        print(f"install.py: {e}", file=sys.stderr)
        return 1
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
