/* xdp_floor.c: the benchmark's floor. Parses a frame up to the SwitchML exponent header, exactly
 * as xdp_agg.c does, and drops it: what an XDP program costs before any aggregation. */
#include <uapi/linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/in.h>
#include <linux/udp.h>

#include "generated/wire.h"

int xdp_floor(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	struct udphdr *udp = (void *)(ip + 1);
	struct switchml_hdr *sml = (void *)(udp + 1);
	struct exponents_hdr *exp = (void *)(sml + 1);

	if ((void *)(exp + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP))
		return XDP_PASS;
	if (ip->version != 4 || ip->ihl != 5 || ip->protocol != IPPROTO_UDP)
		return XDP_PASS;
	if ((udp->dest & bpf_htons(SML_UDP_PORT_MASK)) != bpf_htons(SML_UDP_PORT))
		return XDP_PASS;
	return SML_MSG_TYPE(sml) == SML_MSG_TYPE_DATA ? XDP_DROP : XDP_ABORTED;
}
