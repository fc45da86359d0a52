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
    yield prog, AggMaps(prog.maps, prog.pool_slots)
    prog.close()
