"""AttachOptions (xdp_switch/attach_options.py): one frozen value that `xdp-agg attach`, the
systemd service's config and the pinned state all take and write alike. No root: the attach
itself is faked where a command would make it."""

import dataclasses
import json
from pathlib import Path

import pytest
from harness.cli import xdp_agg_cli as run_cli

from xdp_agg.app import cli, options, service, serving
from xdp_agg.errors import XdpAggError
from xdp_switch import backend as xdp_backend
from xdp_switch import pins
from xdp_switch.attach_options import AttachOptions

# every field away from its default (cpumap excludes frags and skb: EVERY_OTHER has those)
EVERY = AttachOptions(
    topology="switch",
    pool_slots=64,
    variant="spinlock",
    slot_cpus="cpumap",
    cpus=(0, 1),
    cflags=("-DX",),
    forwarding="switched",
)
EVERY_OTHER = AttachOptions(xdp_mode="skb", frags=True, forwarding="off")


def test_every_field_is_off_its_default_in_the_tests_values():
    default = AttachOptions()
    for f in dataclasses.fields(AttachOptions):
        values = {getattr(EVERY, f.name), getattr(EVERY_OTHER, f.name)}
        assert values - {getattr(default, f.name)}, f"{f.name}: add a value to EVERY"


@pytest.mark.parametrize("opts", [AttachOptions(), EVERY, EVERY_OTHER])
def test_round_trip_through_a_dict_and_json(opts):
    d = opts.to_dict()
    assert set(d) == {f.name for f in dataclasses.fields(AttachOptions)}
    assert AttachOptions.from_dict(json.loads(json.dumps(d))) == opts
    assert hash(opts) == hash(AttachOptions.from_dict(d))  # frozen, tuples inside
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.pool_slots = 1  # type: ignore[misc]


def test_from_dict_defaults_what_is_missing_and_leaves_out_what_it_does_not_know():
    opts = AttachOptions.from_dict({"variant": "spinlock", "from_a_newer_version": 1})
    assert opts == AttachOptions(variant="spinlock")


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"topology": "ring"}, "--topology must be one of one-arm, switch, not 'ring'"),
        ({"xdp_mode": "offload"}, "--xdp-mode must be one of native, skb"),
        ({"pool_slots": 0}, "--pool-slots must be 1..16384, not 0"),
        ({"pool_slots": "64"}, "--pool-slots must be 1..16384, not '64'"),
        ({"variant": "x"}, "--variant must be one of percpu, spinlock"),
        ({"slot_cpus": "x"}, "--slot-cpus must be one of rss, cpumap"),
        ({"frags": "yes"}, "--frags is on or off"),
        ({"cpus": []}, "--cpus must name each CPU once, as 0-3,6"),
        ({"cpus": [1, 1]}, "--cpus must name each CPU once"),
        ({"cpus": [-1]}, "--cpus must name each CPU once"),
        ({"slot_cpus": "cpumap", "xdp_mode": "skb"}, "cpumap needs native XDP.*--xdp-mode native"),
        ({"slot_cpus": "cpumap", "frags": True}, "not built for --frags"),
        ({"forwarding": "bridged"}, "--forwarding must be one of routed, switched, off"),
        ({"topology": "one-arm", "forwarding": "routed"}, "needs the switch topology"),
    ],
)
def test_bad_values_say_what_to_write(changes, message):
    with pytest.raises(ValueError, match=message):
        AttachOptions(**changes)
    with pytest.raises(ValueError, match=message):
        AttachOptions.from_dict({**AttachOptions().to_dict(), **changes})


def test_resolved_is_what_was_attached():
    r = AttachOptions(slot_cpus="cpumap").resolved(["eth0"], [1, 0])
    assert (r.topology, r.cpus) == ("one-arm", (0, 1))
    r = AttachOptions(cpus=(1,)).resolved(["p0", "p1"], [0, 1])
    assert (r.topology, r.cpus) == ("switch", None)  # rss has no CPU list
    assert r.forwarding == "off"  # the mode attach chose is what it records


def test_l2switch_forwarding_default_follows_the_ports_subnets():
    from xdp_switch import forwarding

    own = [{"ipv4_nets": ["198.18.1.1/24"]}, {"ipv4_nets": ["198.18.2.1/24"]}]
    shared = [{"ipv4_nets": ["198.18.0.1/24"]}, {"ipv4_nets": ["198.18.0.2/24"]}]
    bare = [{"ipv4_nets": []}, {"ipv4_nets": []}]
    assert forwarding.default_mode("switch", own) == "routed"
    assert forwarding.default_mode("switch", shared) == "switched"
    assert forwarding.default_mode("switch", bare) == "switched"
    assert forwarding.default_mode("one-arm", own[:1]) == "off"
    assert "--forwarding switched" in forwarding.check_mode("routed", "switch", shared)
    r = AttachOptions(forwarding="switched").resolved(["p0", "p1"], [0], "routed")
    assert r.forwarding == "switched"  # asked for wins over the ports' default


# --- the CLI, the service and the pinned state build the same value ----------------------------
def test_every_attach_option_is_a_flag_and_a_service_key():
    fields = {f.name for f in dataclasses.fields(AttachOptions)} - {"cflags"}  # tests only
    assert set(options.ATTACH_FLAGS) == fields
    assert set(service.ATTACH_KEYS.values()) == fields
    flags = {p.name for p in cli.attach.params} - {"ifaces", "as_json"}
    assert flags == fields


def test_the_sample_config_and_the_docs_name_every_attach_key():
    docs = (Path(__file__).resolve().parents[2] / "docs/operations.md").read_text()
    for key in service.ATTACH_KEYS:
        assert f"\n{key}=" in service.SAMPLE_CONFIG and f"| `{key}` |" in docs, key


@pytest.fixture
def fake_attach(monkeypatch):
    """xdp_backend.attach replaced: records (ifaces, opts, name, netns) and returns the state
    the real one would, without root."""
    calls = []

    def attach(ifaces, opts=None, *, name="default", netns=None):
        opts = opts or AttachOptions()
        calls.append((list(ifaces), opts, name, netns))
        done = opts.resolved(ifaces, [0, 1])
        ifs = [{"ifname": i, "ifindex": 2 + n, "prog_id": 7} for n, i in enumerate(ifaces)]
        return pins.State(
            name, done.topology, opts.xdp_mode, netns, ifs, opts.pool_slots, 7, 8, 0.0,
            options={**done.to_dict(), "nr_cpus": 2},
        )  # fmt: skip

    monkeypatch.setattr(xdp_backend, "attach", attach)
    monkeypatch.setattr(cli.cpu_table, "rss_report", lambda i: {"ifname": i, "advice": "-"})
    return calls


def _config(opts: AttachOptions, ifaces: str = "eth0") -> str:
    """A service config with `opts` written as its keys (every key, defaults too)."""
    values = service.config_values(opts)
    return f'INTERFACES="{ifaces}"\n' + "".join(
        f'{key}="{values[name]}"\n' for key, name in service.ATTACH_KEYS.items()
    )


@pytest.mark.parametrize("opts", [AttachOptions(), EVERY, EVERY_OTHER])
def test_the_cli_and_the_service_config_build_the_same_options(opts, fake_attach, xdp_agg):
    opts = dataclasses.replace(opts, cflags=())  # neither a flag nor a key: tests only
    r = xdp_agg("attach", "p0", "p1", *options.attach_args(opts), "--json")
    assert r.exit_code == 0, r.output
    assert fake_attach == [(["p0", "p1"], opts, "default", None)]
    assert service.parse_config(_config(opts, "p0 p1")).attach == opts
    assert json.loads(r.output)["options"]["variant"] == opts.variant


@pytest.mark.parametrize("opts", [AttachOptions(), EVERY, EVERY_OTHER])
def test_service_install_writes_the_attach_options_it_is_given(opts, tmp_path):
    opts = dataclasses.replace(opts, cflags=())
    args = ("service-install", "lab", "--interfaces", "p0 p1", "--root", str(tmp_path), "--json")
    r = run_cli(*args, *options.attach_args(opts))
    assert r.exit_code == 0, r.output
    conf = json.loads(r.output)["config"]
    assert service.parse_config(Path(conf).read_text()).attach == opts


def test_service_start_attaches_with_every_option_in_its_config(fake_attach, monkeypatch, tmp_path):
    """What service-start does with NAME.conf: every attach key reaches the attach, then serve
    runs with SERVE_OPTIONS (both faked: no root, nothing attached)."""
    monkeypatch.setattr(service, "clear_leftover", lambda name: None)
    served = []
    endpoint = serving.Endpoint("h", 1, None, None, None, [])
    monkeypatch.setattr(serving, "resolve", lambda name, opts: endpoint)
    monkeypatch.setattr(serving, "serve", lambda name, opts, ep, **kw: served.append(opts))
    for n, opts in enumerate([dataclasses.replace(EVERY, cflags=()), EVERY_OTHER]):
        conf = tmp_path / f"lab{n}.conf"
        conf.write_text(_config(opts, "p0 p1") + 'SERVE_OPTIONS="--udp-checksum"\n')
        r = run_cli("service-start", f"lab{n}", "--config", str(conf))
        assert r.exit_code == 0, r.output
        assert fake_attach[-1] == (["p0", "p1"], opts, f"lab{n}", None)
        assert served[-1].udp_checksum
        assert f"variant {opts.variant}" in r.output


def test_config_keys_that_do_not_go_together_name_the_keys():
    text = "INTERFACES=eth0\nSLOT_CPUS=cpumap\nXDP_MODE=skb\n"
    with pytest.raises(service.ConfigError, match="x.conf: SLOT_CPUS cpumap needs native XDP"):
        service.parse_config(text, "x.conf")
    with pytest.raises(service.ConfigError, match="FRAGS is yes or no, not 'maybe'"):
        service.parse_config("INTERFACES=eth0\nFRAGS=maybe\n", "x.conf")
    with pytest.raises(service.ConfigError, match="CPU list"):
        service.parse_config("INTERFACES=eth0\nCPUS=0-99999\n", "x.conf")


def test_attach_refuses_options_that_do_not_go_together_as_a_usage_error(xdp_agg):
    r = xdp_agg("attach", "eth0", "--slot-cpus", "cpumap", "--xdp-mode", "skb")
    assert r.exit_code == cli.EXIT_USAGE and "needs native XDP" in r.output


# --- the pinned state --------------------------------------------------------------------------
OLD_STATE = {  # a state file as the version before AttachOptions wrote it
    "name": "old",
    "topology": "one-arm",
    "xdp_mode": "native",
    "netns": None,
    "interfaces": [{"ifname": "eth0", "ifindex": 2, "prog_id": 7}],
    "pool_slots": 512,
    "prog_id": 7,
    "egress_prog_id": 8,
    "attached_at": 0.0,
    "options": {"cflags": [], "nr_cpus": 2, "variant": "spinlock", "frags": True},
}


@pytest.mark.parametrize("options_", [OLD_STATE["options"], None])
def test_an_old_state_file_still_loads(options_, tmp_path, monkeypatch):
    monkeypatch.setenv("XDP_AGG_STATE_DIR", str(tmp_path))
    old = dict(OLD_STATE)
    if options_ is None:
        del old["options"]  # older still: no options at all
    (tmp_path / "old.json").write_text(json.dumps(old))
    state = pins.Instance("old").load_state()
    opts = state.attach_options()
    assert (opts.topology, opts.pool_slots, opts.slot_cpus, opts.cpus) == (
        "one-arm",
        512,
        "rss",
        None,
    )
    assert (opts.variant, opts.frags) == (("spinlock", True) if options_ else ("percpu", False))


def test_a_state_file_with_bad_options_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("XDP_AGG_STATE_DIR", str(tmp_path))
    bad = {**OLD_STATE, "options": {"slot_cpus": "everywhere"}}
    (tmp_path / "old.json").write_text(json.dumps(bad))
    with pytest.raises(XdpAggError, match="not a state file xdp-agg can read.*--slot-cpus"):
        pins.Instance("old").load_state()


class _NoMaps:
    fds: dict = {}  # an old attachment's pins: no forwarding maps (forwarding "off")
    ncpu = 2

    def jobs(self):
        return {}

    def workers(self):
        return []


def test_status_shows_every_option_of_an_old_state(monkeypatch, xdp_agg):
    state = pins.State.from_dict(OLD_STATE)
    monkeypatch.setattr(xdp_backend, "open_instance", lambda name: (state, _NoMaps()))
    monkeypatch.setattr(xdp_backend.links, "xdp_prog_id", lambda ifname: 7)
    st = json.loads(xdp_agg("status", "--json").output)
    assert st["options"] == {**state.attach_options().to_dict(), "nr_cpus": 2}
    assert st["options"]["frags"] and st["options"]["slot_cpus"] == "rss"
    text = xdp_agg("status").output
    assert "attached with variant spinlock, slot CPUs rss, frags" in text
