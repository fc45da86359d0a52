"""Options as data (aggapp.options): the dataclasses the library takes are what the CLI parses,
their defaults are the options' defaults, and check() refuses what does not go together."""

import dataclasses

import pytest

from aggapp import cli, options, serving


def _parsed(command, args: list[str]) -> dict:
    """The parameters click parses for `command ARGS` (the command does not run)."""
    with command.make_context(command.name, args) as ctx:
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
    monkeypatch.setattr(serving, "serve_xdp", lambda name, host, port, **kw: seen.update(kw))
    opts = options.ServeOptions(listen=("127.0.0.1", 1), udp_checksum=True, rejoin_timeout=5.0)
    opts.check()
    ep = serving.resolve("lab", opts)
    assert (ep.host, ep.port, ep.parent) == ("127.0.0.1", 1, None)
    assert ep.secret is not None and (tmp_path / "lab.secret").exists()
    serving.serve("lab", opts, ep)
    assert (seen["udp_checksum"], seen["rejoin_timeout"], seen["secret"]) == (True, 5.0, ep.secret)
    assert seen["limits"] == opts.limits()
