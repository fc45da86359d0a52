"""The builds of the XDP aggregator the BPF tests load (tests/conftest.py's agg_prog)."""

AGG_BUILDS = ["percpu", "spinlock", "percpu-frags"]
# and the build of --slot-cpus cpumap, for the tests that also run against it (they override
# agg_prog with these params): its aggregator sends by redirect where the others XDP_TX
AGG_BUILDS_CPUMAP = [*AGG_BUILDS, "percpu-cpumap"]


def load_agg_build(param: str):
    """A build of AGG_BUILDS_CPUMAP loaded (not attached): (prog, maps), closed after."""
    from xdp_switch import loader
    from xdp_switch.ctl_maps import AggMaps

    variant, _, extra = param.partition("-")
    prog = loader.load(
        pool_slots=256,
        variant=variant,
        frags=extra == "frags",
        slot_cpus="cpumap" if extra == "cpumap" else "rss",
    )
    if extra == "cpumap":  # its cpumap entries and slot table, as attach makes them
        from xdp_switch import slot_cpus

        cpus = slot_cpus.default_cpus()
        slot_cpus.install(prog.maps, prog.progs[loader.PROG_CPUMAP], cpus, prog.pool_slots)
        loader.prepare_test_runs(prog)
    yield prog, AggMaps(prog.maps, prog.pool_slots)
    prog.close()


def unicast_copies(prog, spec) -> tuple[int, int] | None:
    """What AggMaps.create_job needs for a job of unicast delivery (its devmap of copies: an
    interface and the copy program), as the backend gives it; None for other jobs. Tests that
    only test-run the programs give loopback: BPF_PROG_TEST_RUN returns the broadcast's
    XDP_REDIRECT without sending it anywhere."""
    from xdp_agg.proto.jobs import Delivery
    from xdp_switch import loader

    if spec.delivery != Delivery.UNICAST:
        return None
    return loader.TEST_RUN_IFINDEX, prog.progs[loader.PROG_COPY]
