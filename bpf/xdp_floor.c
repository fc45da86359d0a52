/* xdp_floor.c: the benchmark's floor. Runs the parse xdp_agg.c runs (parse.h), reads the
 * SwitchML header's type as the aggregator does, and drops the packet: what an XDP program costs
 * before any aggregation. */
#include "platform.h"
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/in.h>
#include <linux/udp.h>

#include "generated/wire.h"
#include "parse.h"

AGG_PROG("xdp") int xdp_floor(struct xdp_md *ctx)
{
	struct agg_pkt pk;

	if (parse(ctx, &pk) != AGG_PARSE_OK)
		return XDP_PASS;
	return SML_MSG_TYPE(pk.sml) == SML_MSG_TYPE_DATA ? XDP_DROP : XDP_ABORTED;
}

char LICENSE[] SEC("license") = "GPL";
