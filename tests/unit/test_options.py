"""Options as data (xdp_agg.app.options): the dataclasses the library takes are what the CLI parses,
their defaults are the options' defaults, and check() refuses what does not go together."""

import dataclasses

import pytest

from xdp_agg.app import cli, options, serving


def _parsed(command, args: list[str]) -> dict:
    """The parameters click parses for `command ARGS` (the command does not run). With the
    group's context settings, as under `xdp-agg`: click keeps the help option a command's first
    context makes, and tests/house/test_docs.py renders the help after this."""
    settings = cli.main.context_settings
    with command.make_context(command.name, args, **settings) as ctx:
        return dict(ctx.params)


def test_serve_without_options_is_the_default_serve_options():
    params = _parsed(cli.serve, [])
    params.pop("as_json")
    assert options.ServeOptions(**params) == options.ServeOptions()


def test_serve_options_parse_to_their_fields():
    params = _parsed(cli.serve, ["--listen", "10.0.0.1:9", "--request-rate", "5", "--racks", "2"])
    opts = options.ServeOptions(**{k: v for k, v in params.items() if k != "as_json"})
    assert (opts.listen, opts.request_rate, opts.racks) == (("10.0.0.1", 9), 5.0, 2)
    lim = opts.limits()
    assert (lim.rate, lim.burst) == (5.0, 15)


def test_job_options_parse_to_their_fields():
    params = _parsed(
        cli.job_create, ["3", "--workers", "2", "--slots", "8:16", "--agg-port", "48865"]
    )
    assert params.pop("job_id") == 3
    params.pop("as_json")
    opts = options.JobOptions(**params)
    assert (opts.num_workers, opts.slots, opts.agg_port, opts.elems) == (2, (8, 16), 48865, "256")


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"group_ip": "239.1.1.1", "results": "broadcast"}, "either --group"),
        ({"target": "bmv2"}, "needs --ports"),
        ({"parent": "10.0.0.1:48800"}, "needs --rack-rank and --racks"),
        ({"parent": "10.0.0.1:48800", "rack_rank": 0, "target": "bmv2"}, "needs --ports"),
    ],
)
def test_serve_options_that_do_not_go_together(changes, message):
    opts = dataclasses.replace(options.ServeOptions(), **changes)
    with pytest.raises(ValueError, match=message):
        opts.check()


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"parent": "10.0.0.1:48864"}, "needs --parent-mac"),
        (
            {
                "parent": "nowhere",
                "parent_mac": "02:00:00:00:00:01",
                "parent_slot_base": 0,
                "worker_port": 1,
            },
            "octets",  # a name, not an IPv4 address
        ),
    ],
)
def test_job_options_that_do_not_go_together(changes, message):
    opts = dataclasses.replace(options.JobOptions(num_workers=2), **changes)
    with pytest.raises(ValueError, match=message):
        opts.check()


def test_the_library_takes_the_options(monkeypatch, tmp_path):
    """serving.resolve and serving.serve from a ServeOptions built in Python, no click."""
    monkeypatch.setenv("XDP_AGG_STATE_DIR", str(tmp_path))
    seen = {}
    monkeypatch.setattr(serving, "serve_xdp", lambda name, o, ep, **kw: seen.update(o=o, ep=ep))
    opts = options.ServeOptions(listen=("127.0.0.1", 1), udp_checksum=True, rejoin_timeout=5.0)
    opts.check()
    ep = serving.resolve("lab", opts)
    assert (ep.host, ep.port, ep.parent) == ("127.0.0.1", 1, None)
    assert ep.secret is not None and (tmp_path / "lab.secret").exists()
    serving.serve("lab", opts, ep)
    assert seen["o"] is opts and seen["ep"] is ep
    assert ep.limits == opts.limits()


def test_switchml_callers_are_the_allowed_networks_else_the_interfaces_subnets(
    monkeypatch, tmp_path
):
    """--switchml-allow CIDR[,CIDR] parses to networks (host bits dropped) and is the API's
    allow list; without it, the IPv4 subnets of the aggregator's interfaces are; with none,
    serve says to give it. An idle session may be taken over after the job lease."""
    import ipaddress

    import click

    from xdp_agg.errors import XdpAggError

    monkeypatch.setenv("XDP_AGG_STATE_DIR", str(tmp_path))
    params = _parsed(cli.serve, ["--switchml-grpc", "127.0.0.1", "--switchml-allow", "10.1.2.3/24"])
    assert params["switchml_allow"] == (ipaddress.ip_network("10.1.2.0/24"),)
    with pytest.raises(click.BadParameter, match="CIDR"):
        _parsed(cli.serve, ["--switchml-grpc", "127.0.0.1", "--switchml-allow", "10.1.2.0/33"])
    with pytest.raises(ValueError, match="--switchml-allow needs --switchml-grpc"):
        options.ServeOptions(switchml_allow=params["switchml_allow"]).check()
    base = dict(listen=("127.0.0.1", 1), switchml_grpc=("127.0.0.1", 50099))
    ep = serving.resolve(
        "lab", options.ServeOptions(**base, switchml_allow=params["switchml_allow"])
    )
    assert ep.switchml.allow == params["switchml_allow"]
    assert ep.switchml.idle_takeover == options.ServeOptions().job_lease
    assert any("for callers in 10.1.2.0/24" in n for n in ep.notes)
    nets = {"p0": ["198.18.0.1/24", "198.18.0.9/24"], "p1": ["198.18.1.1/24"], "p2": []}
    monkeypatch.setattr(serving, "aggregator_interfaces", lambda name: list(nets))
    monkeypatch.setattr(serving.links, "addresses", lambda i: {"ipv4_nets": nets[i]})
    ep = serving.resolve("lab", options.ServeOptions(**base, job_lease=0))
    assert ep.switchml.allow == tuple(
        ipaddress.ip_network(n) for n in ("198.18.0.0/24", "198.18.1.0/24")
    )
    assert ep.switchml.idle_takeover == options.ServeOptions().barrier_timeout  # no leases
    nets.update(p0=[], p1=[])
    with pytest.raises(XdpAggError, match="give --switchml-allow"):
        serving.resolve("lab", options.ServeOptions(**base))


# --- hostlib's options ---------------------------------------------------------------------------
def test_host_options_from_the_environment_and_given_ones():
    from hostlib.options import DEFAULT_WINDOW, HostOptions

    assert HostOptions.from_env({}) == HostOptions()
    assert (HostOptions().elems, HostOptions().window) == ("auto", DEFAULT_WINDOW)
    env = {
        "XDP_AGG_ELEMS": "768",
        "XDP_AGG_WINDOW": "32",
        "XDP_AGG_TIMEOUT": "2.5",
        "XDP_AGG_IP": "10.0.0.2",
        "XDP_AGG_NATIVE": "0",
        "XDP_AGG_SPIN": "0",
        "XDP_AGG_DATA_PATH": "auto",
        "XDP_AGG_SECRET_FILE": "/s",
        "XDP_AGG_FALLBACK": "gloo",
    }
    o = HostOptions.from_env(env)
    assert (o.elems, o.window, o.timeout, o.ip) == (768, 32, 2.5, "10.0.0.2")
    assert (o.native, o.spin, o.data_path, o.secret_file, o.fallback) == (
        False,
        False,
        "auto",
        "/s",
        "gloo",
    )
    # given fields win; None leaves the environment's
    o = HostOptions.from_env(env, window=8, ip=None)
    assert (o.window, o.ip) == (8, "10.0.0.2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.window = 4  # type: ignore[misc]
    assert o.replace(window=4).window == 4


@pytest.mark.parametrize(
    "env,message",
    [
        ({"XDP_AGG_ELEMS": "lots"}, "XDP_AGG_ELEMS='lots'"),
        ({"XDP_AGG_ELEMS": "100"}, "not a wire size"),
        ({"XDP_AGG_WINDOW": "many"}, "XDP_AGG_WINDOW='many'"),
        ({"XDP_AGG_WINDOW": "0"}, "window must be at least 1"),
        ({"XDP_AGG_DATA_PATH": "dpdk"}, "data_path must be one of"),
        ({"XDP_AGG_FALLBACK": "nccl"}, "XDP_AGG_FALLBACK must be 'gloo'"),
    ],
)
def test_host_options_refuse_bad_values(env, message):
    from hostlib.options import HostOptions

    with pytest.raises(ValueError, match=message):
        HostOptions.from_env(env)


def test_host_options_from_a_worker_command_line():
    import argparse

    from hostlib.options import HostOptions

    args = argparse.Namespace(rank=1, elems=768, window=None, timeout=9.0, plan="[]")
    o = HostOptions.from_args(args, progress=True)
    assert (o.elems, o.window, o.timeout, o.progress) == (768, HostOptions().window, 9.0, True)


def test_init_takes_at_most_eight_parameters():
    import inspect

    import hostlib

    assert len(inspect.signature(hostlib.init).parameters) <= 8
    assert "Faults" not in hostlib.__all__  # the tests' loss generator: hostlib.engine.Faults


def test_only_hostlib_options_reads_the_environment():
    """No module of hostlib but options.py reads the environment (XDP_AGG_* or any other but
    torchrun's run id, which names the backend's jobs)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "hostlib"
    readers = re.compile(r"os\.environ|os\.getenv|getenv\(")
    found = []
    for path in sorted(root.rglob("*.[pch]*")):
        if path.suffix not in (".py", ".c", ".h") or path.name == "options.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if readers.search(line) and "TORCHELASTIC_RUN_ID" not in line:
                found.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not found, found
