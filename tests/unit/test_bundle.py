"""The offline bundle's logic without the network, without root where it can (`make bundle` and
tools/bundle/install.py; docs/install-offline.md).

The resolver of tools/bundle/build.py runs on synthetic package records. install.py runs on a
tiny synthetic bundle made here: debs built with dpkg-deb holding a library the system lacks, one
whose soname the system has (libc.so.6: it must not be linked) and a tool linked against the
first; a hand-made wheel with an `xdp-agg` console script; pip's wheel from the system
(/usr/share/python-wheels). The install runs under `unshare -n` where that works (no network at
all), in env mode (no ld.so.conf.d, no ldconfig), with os-release redirected into a temporary
directory.
"""

import base64
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools" / "bundle"
TAG = f"cp{sys.version_info[0]}{sys.version_info[1]}"
MULTIARCH = "usr/lib/x86_64-linux-gnu"


def _module(name):
    spec = importlib.util.spec_from_file_location(f"bundle_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _module("build")
install = _module("install")

# --- the resolver ------------------------------------------------------------------------------

RECORDS = """\
Package: app
Version: 1.0
Depends: libfoo (>= 1), python3:any, libbar | libbaz, mta
Pre-Depends: libc6

Package: libfoo
Version: 1:2.0
Depends: libc6, libdeep

Package: libdeep
Version: 3

Package: libbar
Version: 1
Depends: libc6

Package: libbaz
Version: 1

Package: exim
Version: 4
Provides: mta
Depends: libdeep

Package: libc6
Version: 2.36
Priority: required

Package: dpkg
Version: 1.21
Essential: yes
Depends: libc6, libzstd

Package: libzstd
Version: 1.5

Package: python3
Version: 3.11
Depends: libffi8

Package: libffi8
Version: 3.4
"""


def test_depends_are_parsed_to_names_and_alternatives():
    got = build.parse_depends("libfoo (>= 1), python3:any, libbar | libbaz [amd64], x (<< 2)")
    assert got == [["libfoo"], ["python3"], ["libbar", "libbaz"], ["x"]]


def test_closure_leaves_out_the_base_and_the_targets_python():
    records = build.parse_records(RECORDS)
    base = build.base_packages(records)
    assert base == {"libc6", "dpkg", "libzstd", "python3", "libffi8"}
    got = build.closure(records, ["app"], have=frozenset(base))
    # first alternative, a virtual package through its provider, deps followed, base not
    assert got == ["app", "libfoo", "libbar", "exim", "libdeep"]


def test_an_alternative_already_chosen_satisfies_the_group():
    records = build.parse_records(RECORDS + "\nPackage: two\nDepends: libbaz, libbar | libbaz\n")
    assert build.closure(records, ["two"]) == ["two", "libbaz"]


def test_the_box_gets_no_compiler_llvm_or_kernel_headers():
    """The BPF objects ship built (in the project's wheel and sdist): the box needs libbpf1 to
    load them, and nothing that compiles."""
    assert "libbpf1" in build.ROOTS
    heavy = ("clang", "llvm", "linux-headers", "bpfcc", "gcc", "libbpfcc")
    assert not [r for r in build.ROOTS if any(h in r for h in heavy)]
    assert "bcc" not in build.SMOKE_IMPORTS


def test_wheel_platforms_stop_at_debian_12s_glibc():
    tags = build.platforms()
    assert tags[0] == "manylinux_2_36_x86_64" and "manylinux_2_17_x86_64" in tags
    assert "manylinux_2_37_x86_64" not in tags


# --- what the target is ------------------------------------------------------------------------

MANIFEST = {
    "targets": {
        "cp311": {"python": "3.11", "dist": "Debian 12"},
        "cp312": {"python": "3.12", "dist": "Ubuntu 24.04"},
    }
}


@pytest.mark.parametrize(
    "release, version, tag, noted",
    [
        ('ID=debian\nVERSION_ID="12"\n', (3, 11), "cp311", False),
        ('ID=ubuntu\nVERSION_ID="24.04"\n', (3, 12), "cp312", False),
        ('ID=ubuntu\nVERSION_ID="24.04"\n', (3, 11), "cp311", True),
        ("ID=fedora\nVERSION_ID=40\n", (3, 12), "cp312", True),
    ],
)
def test_the_target_follows_the_python(release, version, tag, noted):
    got, note = install.pick_target(MANIFEST, install.parse_os_release(release), version)
    assert got == tag and bool(note) == noted


def test_a_python_without_wheels_is_refused():
    release = install.parse_os_release("ID=debian\nVERSION_ID=13\n")
    with pytest.raises(install.InstallError, match="not for Python 3.13"):
        install.pick_target(MANIFEST, release, (3, 13))


def test_ldconfig_p_is_read_for_x86_64_outside_our_links():
    text = (
        "3 libs found in cache `/etc/ld.so.cache'\n"
        "\tlibc.so.6 (libc6,x86-64, OS ABI: Linux 3.2.0) => /lib/x86_64-linux-gnu/libc.so.6\n"
        "\tlibc.so.6 (libc6) => /lib/i386-linux-gnu/libc.so.6\n"
        "\tlibLLVM-14.so.1 (libc6,x86-64) => /opt/x/lib/ld/libLLVM-14.so.1\n"
        "\tlibi386only.so.1 (libc6) => /lib/i386-linux-gnu/libi386only.so.1\n"
    )
    assert install.system_sonames(text, ignore=Path("/opt/x/lib/ld")) == {"libc.so.6"}


def test_the_conf_file_is_named_by_the_prefix():
    assert install.conf_name(Path("/opt/xdp-agg")) == "xdp-agg-opt-xdp-agg.conf"


# --- install.py on a synthetic bundle ----------------------------------------------------------

LIB_C = "int xdpaggtest_value(void) { return 42; }\n"
TOOL_C = (
    "#include <stdio.h>\nint xdpaggtest_value(void);\n"
    'int main(void) { printf("tool ok %d\\n", xdpaggtest_value()); return 0; }\n'
)
FAKE_MAIN = "def main():\n    print('fake xdp-agg 0.0.0')\n"


def _cc(*args, cwd):
    subprocess.run(["cc", *map(str, args)], cwd=cwd, check=True, capture_output=True)


def _deb(src: Path, name: str, out: Path) -> str:
    """A deb of the tree src (dpkg-deb, no root: --root-owner-group)."""
    (src / "DEBIAN").mkdir(parents=True, exist_ok=True)
    (src / "DEBIAN" / "control").write_text(
        f"Package: {name}\nVersion: 1.0\nArchitecture: amd64\nMaintainer: t <t@t>\n"
        f"Description: test\n"
    )
    file = out / f"{name}_1.0_amd64.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", src, file],
        check=True,
        capture_output=True,
    )
    return file.name


def _wheel(path: Path, files: dict[str, str]) -> None:
    """A wheel of files (RECORD added)."""
    record = []
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            data = text.encode()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{name},sha256={digest.decode()},{len(data)}")
            z.writestr(name, data)
        dist = "xdp_agg-0.0.0.dist-info"
        z.writestr(f"{dist}/RECORD", "\n".join(record + [f"{dist}/RECORD,,"]) + "\n")


def _fake_project_wheel(dest: Path) -> str:
    name = "xdp_agg-0.0.0-py3-none-any.whl"
    dist = "xdp_agg-0.0.0.dist-info"
    _wheel(
        dest / name,
        {
            "xdpaggfake/__init__.py": FAKE_MAIN,
            f"{dist}/METADATA": "Metadata-Version: 2.1\nName: xdp-agg\nVersion: 0.0.0\n",
            f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n",
            f"{dist}/entry_points.txt": "[console_scripts]\nxdp-agg = xdpaggfake:main\n",
        },
    )
    return name


def _synthetic_debs(tmp: Path, debs: Path) -> list[str]:
    """The test library (and one claiming libc.so.6's soname) and the tool, as two debs."""
    lib = tmp / "deb-lib"
    (lib / MULTIARCH).mkdir(parents=True)
    (tmp / "lib.c").write_text(LIB_C)
    real = lib / MULTIARCH / "libxdpaggtest.so.1.0"
    _cc("-shared", "-fPIC", "-Wl,-soname,libxdpaggtest.so.1", "-o", real, "lib.c", cwd=tmp)
    (lib / MULTIARCH / "libxdpaggtest.so.1").symlink_to("libxdpaggtest.so.1.0")
    _cc("-shared", "-fPIC", "-Wl,-soname,libc.so.6", "-o", lib / MULTIARCH / "libfakec.so",
        "lib.c", cwd=tmp)  # fmt: skip
    tool = tmp / "deb-tool"
    (tool / "usr" / "sbin").mkdir(parents=True)
    (tmp / "tool.c").write_text(TOOL_C)
    _cc("-o", tool / "usr/sbin/xdpaggtesttool", "tool.c", real, cwd=tmp)
    names = ("lib", "tool")
    return [_deb(tmp / f"deb-{n}", f"xdpagg-test-{n}", debs) for n in names]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """A synthetic bundle directory, as install.py finds it next to itself."""
    for tool in ("dpkg-deb", "dpkg", "cc", "ldconfig", "ldd"):
        if not shutil.which(tool, path=os.pathsep.join([os.environ["PATH"], *install.SBIN])):
            pytest.skip(f"{tool} is missing")
    pips = sorted(Path("/usr/share/python-wheels").glob("pip-*.whl"))
    if not pips:
        pytest.skip("no pip wheel in /usr/share/python-wheels (Debian's python3-pip-whl)")
    tmp = tmp_path_factory.mktemp("bundle")
    b = tmp / "xdp-agg-bundle-0.0.0"
    for d in ("debs", "wheels"):
        (b / d).mkdir(parents=True)
    files = _synthetic_debs(tmp, b / "debs")
    shutil.copy2(pips[-1], b / "wheels")
    manifest = {
        "name": b.name,
        "version": "0.0.0",
        "commit": "test",
        "debs": [{"package": f.split("_")[0], "file": f} for f in files],
        "tools": {"xdpaggtesttool": "xdpagg-test-tool"},
        "commands": ["xdp-agg"],
        "smoke_imports": ["xdpaggfake"],
        "extras": [],
        "sdist": None,
        "targets": {
            TAG: {
                "python": "%d.%d" % sys.version_info[:2],
                "dist": "Debian 12",
                "wheels": [pips[-1].name],
                "project_wheel": _fake_project_wheel(b / "wheels"),
            }
        },
    }
    (b / "manifest.json").write_text(json.dumps(manifest))
    shutil.copy2(TOOLS / "install.py", b / "install.py")
    (tmp / "os-release").write_text('ID=debian\nVERSION_ID="12"\nPRETTY_NAME="Test 12"\n')
    return b


def _offline() -> list[str]:
    """unshare -n (a network namespace with only a loopback that is down) where it works."""
    ok = shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"]).returncode == 0
    return ["unshare", "-n"] if ok else []


def _install(bundle: Path, prefix: Path) -> subprocess.CompletedProcess:
    # The venv comes from the interpreter under the running venv: a venv of a venv would not
    # see the system site packages the real install relies on.
    argv = [*_offline(), sys.executable, bundle / "install.py", "--prefix", prefix]
    argv += ["--python", sys._base_executable, "--ld-mode", "env", "--no-bpf"]
    argv += ["--os-release", bundle.parent / "os-release"]
    return subprocess.run(list(map(str, argv)), capture_output=True, text=True, timeout=300)


def test_install_uses_only_the_bundle_and_links_only_what_is_missing(bundle, tmp_path):
    prefix = tmp_path / "prefix"
    cp = _install(bundle, prefix)
    out = cp.stdout + cp.stderr
    assert cp.returncode == 0, out
    # the library the system lacks is linked; the one claiming libc.so.6's soname is not
    assert sorted(os.listdir(prefix / "lib" / "ld")) == ["libxdpaggtest.so.1"]
    assert "1 of 2 libraries are missing here" in out
    # the smoke test ran the command, the imports and the tool
    assert "fake xdp-agg 0.0.0" in out and "tool ok 42" in out
    assert "import xdpaggfake: " in out
    tool = subprocess.run([prefix / "bin" / "xdpaggtesttool"], capture_output=True, text=True)
    assert tool.stdout == "tool ok 42\n"  # the wrapper finds the library (LD_LIBRARY_PATH)


def test_reinstall_and_uninstall(bundle, tmp_path):
    prefix = tmp_path / "prefix"
    assert _install(bundle, prefix).returncode == 0
    again = _install(bundle, prefix)  # the marker lets it replace its own install
    assert again.returncode == 0, again.stdout + again.stderr
    subprocess.run([prefix / "uninstall.sh"], check=True)
    assert not prefix.exists()


def test_a_foreign_prefix_is_refused(bundle, tmp_path):
    prefix = tmp_path / "prefix"
    prefix.mkdir()
    (prefix / "precious").write_text("mine")
    cp = _install(bundle, prefix)
    assert cp.returncode == 1 and "holds no earlier install" in cp.stderr
    assert (prefix / "precious").read_text() == "mine"


def test_the_soname_is_read_from_the_elf(bundle, tmp_path):
    root = tmp_path / "root"
    subprocess.run(["dpkg", "-x", bundle / "debs" / "xdpagg-test-lib_1.0_amd64.deb", root])
    libs = install.bundle_libs(root)
    assert sorted(libs) == ["libc.so.6", "libxdpaggtest.so.1"]
    assert libs["libxdpaggtest.so.1"].name == "libxdpaggtest.so.1.0"
    assert install.elf_soname(Path(sys.executable).resolve()) is None  # an executable


def test_without_a_project_wheel_or_a_compiler_it_says_what_to_do(monkeypatch, tmp_path):
    manifest = {
        "sdist": "xdp_agg-0.0.0.tar.gz",
        "targets": {TAG: {"python": "3.x", "wheels": ["pip-1-py3-none-any.whl"]}},
    }
    monkeypatch.setattr(install.shutil, "which", lambda *a, **k: None)
    with pytest.raises(install.InstallError, match=r"lacks a C compiler \(cc\)"):
        install.pip_install(tmp_path, manifest, TAG, Path(sys.executable))
