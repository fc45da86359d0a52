#!/bin/bash
# Install an offline bundle into a bare Debian 12 with no network, as docs/install-offline.md
# measured it: `debootstrap --variant=minbase --include=python3 bookworm` (this step needs the
# archive; the root file system is kept in WORK and reused), then, in a mount and network
# namespace of their own (`unshare -m -n`: only a loopback that is down), a chroot into a fresh
# copy of it, install.py --prefix /opt/xdp-agg with OPTIONS, and with --demo the 4-worker demo
# (python -m xdp_agg.cluster.demo) in the same chroot, with a bpffs and a /run of its own.
#
#   sudo tools/bundle/chroot-check.sh build/bundle/xdp-agg-bundle-0.1.0.tar [--demo] [OPTIONS]
#
# WORK (default /tmp/xdp-agg-chroot-check) keeps the minbase root file system; delete it after.
set -euo pipefail
TAR=$(realpath "$1"); shift
DEMO=0
if [ "${1:-}" = --demo ]; then DEMO=1; shift; fi
WORK=${WORK:-/tmp/xdp-agg-chroot-check}
NAME=$(basename "$TAR" .tar)
mkdir -p "$WORK"
if [ ! -x "$WORK/base/usr/bin/python3" ]; then
	command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap >/dev/null
	rm -rf "$WORK/base"
	debootstrap --variant=minbase --include=python3 bookworm "$WORK/base" \
		http://deb.debian.org/debian >"$WORK/debootstrap.log"
fi
rm -rf "$WORK/root" && cp -a "$WORK/base" "$WORK/root"
tar -C "$WORK/root/tmp" -xf "$TAR"
exec unshare -m -n --propagation private /bin/bash -euo pipefail -c '
R=$1 NAME=$2 DEMO=$3; shift 3
mount --rbind /dev "$R/dev"; mount -t proc proc "$R/proc"; mount --rbind /sys "$R/sys"
echo "network interfaces here: $(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d " " | xargs)"
echo "the chroot lacks: $(for t in ip tc nft ethtool sysctl; do
	chroot "$R" sh -c "command -v $t >/dev/null" || echo -n "$t "; done)"
/usr/bin/time -f "install.py: %e s" chroot "$R" /bin/sh -c \
	"cd /tmp/$NAME && python3 install.py --prefix /opt/xdp-agg $*"
if [ "$DEMO" = 1 ]; then
	mount -t bpf bpf "$R/sys/fs/bpf"; mount -t tmpfs tmpfs "$R/run"
	chroot "$R" /bin/sh -c "cd /tmp && /opt/xdp-agg/bin/xdp-agg-python -m xdp_agg.cluster.demo"
fi
chroot "$R" /opt/xdp-agg/uninstall.sh && echo "uninstalled: $(chroot "$R" /sbin/ldconfig -p |
	grep -c /opt/xdp-agg || true) libraries of the prefix left in ld.so'"'"'s cache"
' - "$WORK/root" "$NAME" "$DEMO" "$@"
