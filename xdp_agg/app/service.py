"""The aggregator as a systemd service on a middle box: a template unit per aggregator name, its
config file, and the two commands the unit runs.

    /etc/systemd/system/xdp-agg@.service   the template unit (install_files writes it)
    /etc/xdp-agg/NAME.conf                 what aggregator NAME attaches to and serves (below)

    systemctl enable --now xdp-agg@NAME    ExecStart:    xdp-agg service-start NAME
                                           ExecStopPost: xdp-agg service-stop NAME

`service-start` reads the config, attaches the XDP program to its interfaces (replacing what an
earlier run of the same name left), and runs the control endpoint in the foreground until
SIGTERM. `service-stop` detaches, and is an ExecStopPost rather than an ExecStop so that it runs
however the service ended (stopped, crashed, or failed to start): the next start, a restart on
failure included, begins from nothing attached. After a reboot the pins are gone and the unit
attaches again.

The config file is KEY=VALUE lines (the syntax of a systemd EnvironmentFile: `#` comments,
values optionally in double quotes); lists are separated by spaces. Every option of `xdp-agg
attach` is a key (ATTACH_KEYS), read into the one AttachOptions that `attach` takes too.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from xdp_agg.errors import XdpAggError
from xdp_switch import backend as xdp_backend
from xdp_switch import pins, slot_cpus

from . import options
from .options import AttachOptions

UNIT_NAME = "xdp-agg@.service"
CONFIG_DIR = Path("/etc/xdp-agg")
UNIT_DIR = Path("/etc/systemd/system")


class ConfigError(XdpAggError):
    """The service's config file is missing or says something we cannot use."""


@dataclass
class ServiceConfig:
    """One aggregator's service settings (the keys of NAME.conf)."""

    interfaces: list[str]  # INTERFACES: one (one-arm) or one per worker port (switch)
    # how it attaches: every option of `xdp-agg attach`, each a key of its own (ATTACH_KEYS)
    attach: AttachOptions = field(default_factory=AttachOptions)
    listen: str = ""  # LISTEN: HOST:PORT of the control endpoint ("": serve's default address)
    secret_file: str = ""  # SECRET_FILE: the deployment secret ("": serve's default place)
    netns: str | None = None  # NETNS: a network namespace to run in (rarely on a middle box)
    serve_options: list[str] = field(default_factory=list)  # SERVE_OPTIONS: more `serve` options

    def attach_args(self) -> list[str]:
        """The `xdp-agg attach` arguments this config means (defaults left out)."""
        return [*self.interfaces, *options.attach_args(self.attach)]

    def serve_args(self) -> list[str]:
        """The `xdp-agg serve` arguments this config means."""
        args = ["--listen", self.listen] if self.listen else []
        if self.secret_file:
            args += ["--secret-file", self.secret_file]
        return args + self.serve_options


# The attach options' keys: the field's name in capitals, one per option of `xdp-agg attach`
# (TOPOLOGY=switch is --topology switch, FRAGS=yes is --frags, CPUS=0-3 is --cpus 0-3).
ATTACH_KEYS = {name.upper(): name for name in options.ATTACH_FLAGS}
_KEYS = {"INTERFACES", *ATTACH_KEYS, "LISTEN", "SECRET_FILE", "NETNS", "SERVE_OPTIONS"}
# Keys an older version's sample config wrote, read and ignored: TOOLCHAIN chose bcc or libbpf
# before bcc left the attach path (every build is now the object shipped, loaded by libbpf).
RETIRED_KEYS = {"TOOLCHAIN"}
_YES, _NO = ("yes", "true", "on", "1"), ("no", "false", "off", "0")


def config_path(name: str, config_dir: Path | None = None) -> Path:
    """Where aggregator `name`'s config lives."""
    return (config_dir or CONFIG_DIR) / f"{pins.check_name(name)}.conf"


def _attach_value(key: str, text: str):
    """The AttachOptions value of config key `key` (an ATTACH_KEYS key) written as `text`;
    ValueError for one that is not."""
    if key == "POOL_SLOTS":
        return int(text) if text.isdigit() else text  # AttachOptions says what is wrong
    if key == "FRAGS":
        if text.lower() not in _YES + _NO:
            raise ValueError(f"FRAGS is yes or no, not {text!r}")
        return text.lower() in _YES
    if key == "CPUS":
        return slot_cpus.parse_cpus(text)
    return text


def config_values(opts: AttachOptions) -> dict[str, str]:
    """`opts` as the config's values, by field name (what _attach_value reads back): yes or no,
    CPU lists as 0,1,6, empty for None."""

    def text(value) -> str:
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, list):
            return ",".join(map(str, value))
        return "" if value is None else str(value)

    return {name: text(value) for name, value in opts.to_dict().items() if name != "cflags"}


def _attach_options(raw: dict[str, str], source: str) -> AttachOptions:
    """The AttachOptions of the config's attach keys (an empty or missing one: the default);
    ConfigError naming the key (its name, where AttachOptions says the option's)."""
    flags = {spec[0][0]: name.upper() for name, spec in options.ATTACH_FLAGS.items()}
    try:
        values = {
            name: _attach_value(key, raw[key]) for key, name in ATTACH_KEYS.items() if raw.get(key)
        }
        return AttachOptions(**values)
    except ValueError as e:
        said = re.sub(r"--[a-z-]+", lambda m: flags.get(m.group(0), m.group(0)), str(e))
        raise ConfigError(f"{source}: {said}") from None


def parse_config(text: str, source: str = "config") -> ServiceConfig:
    """A ServiceConfig from NAME.conf's text; ConfigError naming the line for what is wrong."""
    raw: dict[str, str] = {}
    for no, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if sep and key in RETIRED_KEYS:
            continue
        if not sep or key not in _KEYS:
            raise ConfigError(
                f"{source}:{no}: expected one of {', '.join(sorted(_KEYS))}=VALUE, got {line!r}"
            )
        try:  # strips the quotes an EnvironmentFile allows; lists are then split on spaces
            raw[key] = " ".join(shlex.split(value))
        except ValueError as e:
            raise ConfigError(f"{source}:{no}: {key}: {e}") from None
    ifaces = raw.get("INTERFACES", "").split()
    if not ifaces:
        raise ConfigError(
            f"{source}: INTERFACES is empty: name the interface(s) to attach to, "
            'e.g. INTERFACES=eth1 (one-arm) or INTERFACES="p0 p1 p2 p3" (switch)'
        )
    cfg = ServiceConfig(interfaces=ifaces, attach=_attach_options(raw, source))
    cfg.listen = raw.get("LISTEN", "")
    cfg.secret_file = raw.get("SECRET_FILE", "")
    cfg.netns = raw.get("NETNS") or None
    try:
        cfg.serve_options = shlex.split(raw.get("SERVE_OPTIONS", ""))
    except ValueError as e:
        raise ConfigError(f"{source}: SERVE_OPTIONS: {e}") from None
    return cfg


def read_config(name: str, path: Path | None = None) -> ServiceConfig:
    """Aggregator `name`'s config, from `path` or /etc/xdp-agg/NAME.conf."""
    path = path or config_path(name)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(
            f"no config {path}: `xdp-agg service-install {name}` writes a sample to edit"
        ) from None
    return parse_config(text, str(path))


def clear_leftover(name: str) -> dict | None:
    """Detach an aggregator `name` that is still attached (an earlier run of the service that
    could not clean up): the service owns that name, so its jobs go too (force). The detach
    report, or None."""
    if not pins.Instance(name).exists():
        return None
    return xdp_backend.detach(name, force=True)


def stop(name: str) -> dict | None:
    """What ExecStopPost runs: detach `name` if it is attached (nothing to do is no error)."""
    return clear_leftover(name)


# --- installing ---------------------------------------------------------------------------------
UNIT_TEMPLATE = """\
# xdp-agg: the XDP aggregator NAME (%i) and its control endpoint, configured by
# /etc/xdp-agg/%i.conf. Written by `xdp-agg service-install`; see docs/operations.md, "Install on a
# middle box".
[Unit]
Description=xdp-agg in-network aggregator %i (XDP program and control endpoint)
Documentation=man:systemd.service(5)
After=network-online.target
Wants=network-online.target
ConditionPathExists={config_dir}/%i.conf

[Service]
Type=simple
# The program and its maps are pinned in bpffs; systemd mounts it on most systems, not on all.
ExecStartPre=/bin/sh -c 'mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf'
ExecStart={exe} service-start %i --config {config_dir}/%i.conf
# ExecStopPost, not ExecStop: it also runs after a crash or a failed start, so every start
# (a restart on failure too) begins with nothing attached.
ExecStopPost={exe} service-stop %i
Restart=on-failure
RestartSec=5
# 2: a usage error in SERVE_OPTIONS; 3: not root, no bpffs or no BPF objects. Restarting
# cannot fix either; `journalctl -u xdp-agg@%i` says what to do.
RestartPreventExitStatus=2 3
TimeoutStopSec=30

[Install]
WantedBy=multi-user.target
"""

SAMPLE_CONFIG = """\
# xdp-agg service config for aggregator {name}: `systemctl restart xdp-agg@{name}` applies it.
# KEY=VALUE lines; lists are separated by spaces (quote them).

# The interface(s) the XDP program attaches to: one for the one-arm topology (every worker
# behind it), or one per worker port for the switch topology.
INTERFACES="{interfaces}"

# one-arm | switch; empty: one-arm for one interface, switch for several.
TOPOLOGY={topology}

# native (in the driver) | skb (generic XDP: any interface, slower).
XDP_MODE={xdp_mode}

# Aggregation slots shared by all jobs (1..16384).
POOL_SLOTS={pool_slots}

# percpu (the design) | spinlock (the baseline).
VARIANT={variant}

# yes: load as an XDP multi-buffer program, for frames larger than a page (jobs of 1024 and 2048
# elements per packet, MTU 4200 and 9000).
FRAGS={frags}

# rss: each packet aggregated on the CPU the NIC's receive hash chose | cpumap: each slot's
# packets redirected to the one CPU that owns it (native XDP only, not with FRAGS).
SLOT_CPUS={slot_cpus}

# With SLOT_CPUS=cpumap: the CPUs that aggregate, as 0-3,6; empty: every CPU the service may use.
CPUS={cpus}

# The switch topology's ordinary traffic between its ports: routed (FIB lookup and redirect,
# the kernel's forwarding sysctls set on the ports until detach) | switched (learned MAC table,
# flooding) | off; empty: routed when every port has a subnet of its own, else switched.
FORWARDING={forwarding}

# HOST:PORT of the control endpoint the workers' host library connects to; empty: the one
# IPv4 address of INTERFACES, port 48800. 0.0.0.0 (every address) only when written here.
LISTEN={listen}

# The deployment secret workers must prove (created with mode 0600 when absent). Give each
# worker a copy (mode 0600) and XDP_AGG_SECRET_FILE=<its path>. Here, it survives reboots.
SECRET_FILE={secret_file}

# More `xdp-agg serve` options, e.g. "--udp-checksum --barrier-timeout 300". One-arm results go
# to a multicast group per job (the switch needs IGMP snooping and a querier, docs/design.md); add
# "--results broadcast" for the subnet broadcast, or "--group-base 239.77.0.0/24".
SERVE_OPTIONS=
"""


def default_exe() -> str:
    """How the unit runs xdp-agg: the script beside this interpreter (a venv's or pip's), or
    the interpreter with -m when there is none (an uninstalled checkout)."""
    script = Path(sys.executable).parent / "xdp-agg"
    if script.exists():
        return str(script)
    return f"{sys.executable} -m xdp_agg.app.cli"


def install_files(
    root: Path,
    name: str,
    interfaces: list[str],
    *,
    exe: str | None = None,
    listen: str = "",
    attach: AttachOptions | None = None,
    force: bool = False,
) -> dict:
    """Write the template unit and a sample config for `name` under `root` (/ for real), whose
    attach keys say `attach` (default: AttachOptions()). An existing config is kept unless
    `force`; the unit is always rewritten (it holds no settings). Returns what was written and
    kept."""
    config_dir = root / CONFIG_DIR.relative_to("/")
    unit_dir = root / UNIT_DIR.relative_to("/")
    unit = unit_dir / UNIT_NAME
    conf = config_dir / f"{pins.check_name(name)}.conf"
    unit_dir.mkdir(parents=True, exist_ok=True)
    config_dir.mkdir(parents=True, exist_ok=True)
    unit.write_text(UNIT_TEMPLATE.format(exe=exe or default_exe(), config_dir=CONFIG_DIR))
    written, kept = [str(unit)], []
    if conf.exists() and not force:
        kept.append(str(conf))
    else:
        conf.write_text(
            SAMPLE_CONFIG.format(
                name=name,
                interfaces=" ".join(interfaces),
                **config_values(attach or AttachOptions()),
                listen=listen,
                secret_file=CONFIG_DIR / f"{name}.secret",
            )
        )
        os.chmod(conf, 0o644)
        written.append(str(conf))
    return {
        "name": name,
        "unit": str(unit),
        "config": str(conf),
        "written": written,
        "kept": kept,
        "instance": f"xdp-agg@{name}.service",
    }
