"""The BPF objects and their loader (xdp_switch/bpfbuild.py, objload.py, xdp_agg/bpfsys/libbpf.py):
objects built once per flavour, loaded with the machine's sizes set before load, no compiler
needed at load, a verifier refusal explained in plain words. The packet cases, the verifier
budget and the BTF layout load the same objects in their own files."""

import os

import pytest

from xdp_agg import bpfsys
from xdp_agg.bpfsys import libbpf
from xdp_switch import bpfbuild, loader, objload


def test_every_flavour_attach_can_ask_for_is_built():
    """variant x slot CPUs x frags, each its own object (and the floor's)."""
    names = {f.name for f in bpfbuild.FLAVOURS}
    assert len(names) == len(loader.VARIANTS) * len(loader.SLOT_CPUS) * 2
    assert "xdp_agg-percpu" in names and "xdp_agg-spinlock-cpumap-frags" in names
    outs = bpfbuild.build(quiet=True)  # a no-op when up to date
    assert all(p.exists() and not bpfbuild.stale(p) for p in outs)


@pytest.fixture(scope="module")
def built():
    """A libbpf build loaded with 100 slots (not a power of two: the sizes are the loader's)."""
    prog = loader.load(pool_slots=100, slot_cpus="cpumap")
    yield prog
    prog.close()


@pytest.mark.root
@pytest.mark.bpf
def test_sizes_are_set_before_load(built):
    pool = built.pool_slots
    want = {"slots": pool, "slot_owner": pool, "results": 2 * pool, "partials": 2 * pool}
    got = {n: bpfsys.map_info(built.maps[n]).max_entries for n in want}
    assert got == want
    assert bpfsys.map_info(built.maps["cpu_map"]).max_entries == built.nr_cpus
    assert set(built.progs) == set(objload.PROGRAMS + objload.CPUMAP_PROGRAMS)
    assert built.path == bpfbuild.object_path(bpfbuild.Flavour("percpu", cpumap=True))


@pytest.mark.root
@pytest.mark.bpf
def test_the_pool_constant_is_the_loaders(built):
    """agg_pool_slots (const volatile, the bound of every slot number) is in the loaded
    object's read-only data as the loader set it, frozen."""
    import ctypes as ct

    rodata = next(m for m in built.bpf.map_names() if m.endswith(".rodata"))
    fd = built.bpf.map_fd(rodata)
    value = ct.c_uint32()
    assert bpfsys.map_lookup(fd, ct.c_uint32(0), value)
    assert value.value == built.pool_slots == 100


@pytest.mark.root
@pytest.mark.bpf
def test_a_build_loads_without_a_compiler(monkeypatch):
    """Attach needs no clang: the objects are built (here a missing compiler is not called)."""
    bpfbuild.build(quiet=True)
    monkeypatch.setattr(bpfbuild, "CLANG", "/nonexistent/clang")
    prog = loader.load(pool_slots=64)
    prog.close()


@pytest.mark.root
@pytest.mark.bpf
def test_a_skipped_program_is_not_verified(built):
    """Attach's cpumap build skips the plain aggregator: the verifier walks the aggregator once
    (xdp_agg_cpumap), not twice."""
    prog = loader.load(pool_slots=100, slot_cpus="cpumap", skip=(loader.PROG_INGRESS,))
    try:
        assert set(prog.progs) == set(built.progs) - {loader.PROG_INGRESS}
        assert prog.verified[loader.PROG_CPUMAP] == built.verified[loader.PROG_CPUMAP]
        assert sum(prog.verified.values()) < 0.6 * sum(built.verified.values())
    finally:
        prog.close()


@pytest.mark.root
@pytest.mark.bpf
def test_a_copy_program_is_test_runnable(built):
    """loader.test_runnable: the devmap program loaded again as a plain XDP program on the
    build's maps; a frame that is not a result passes it untouched."""
    fd = loader.test_runnable(built, loader.PROG_COPY)
    try:
        arp = bytes(12) + b"\x08\x06" + bytes(28)
        action, out, _ = bpfsys.prog_test_run(fd, arp)
        assert bpfsys.XDP_ACTIONS[action] == "pass" and out == arp
    finally:
        os.close(fd)


@pytest.mark.root
@pytest.mark.bpf
def test_a_test_only_build_compiles_at_load():
    """cflags (race window, mutant) compile a build of their own, its callback linked."""
    prog = loader.load(pool_slots=64, cflags=loader.race_test_cflags(100, mutant=True))
    try:
        assert prog.path.parent == objload.TEST_BUILD_DIR
        assert prog.verified[loader.PROG_INGRESS] > 0
    finally:
        prog.close()


BAD_PROGRAM = """
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
SEC("xdp") int bad_ctx(struct xdp_md *ctx)
{
	return *(volatile long *)((char *)ctx + 4000);
}
char LICENSE[] SEC("license") = "GPL";
"""


@pytest.mark.root
@pytest.mark.bpf
def test_a_refusal_is_explained_in_plain_words(tmp_path):
    """A read past the context: the LoadError names the program, the instruction and the
    verifier's word (objload.explain), from the log libbpf fills."""
    src = tmp_path / "bad.c"
    src.write_text(BAD_PROGRAM)
    obj = libbpf.Object(bpfbuild.compile_object(src, tmp_path / "bad.o"))
    try:
        with pytest.raises(libbpf.ObjectLoadError) as e:
            obj.load()
    finally:
        obj.close()
    why = str(objload._refusal(e.value, frags=False))
    assert why.startswith("the kernel verifier rejected bad_ctx: at instruction 0 "), why
    assert "invalid bpf_context access" in why, why
