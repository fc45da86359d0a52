/* The parse both XDP programs share (xdp_agg.c, and xdp_floor.c, the benchmark's floor): is a
 * frame ours, and where are its headers. Counting is left to the caller, so the floor program
 * needs no maps and measures exactly this code. */
#ifndef XDP_AGG_PARSE_H
#define XDP_AGG_PARSE_H

#define AGG_IP_MF	   0x2000 /* IPv4 more-fragments flag */
#define AGG_IP_OFFSET_MASK 0x1fff /* IPv4 fragment offset */

/* Headers of one of our packets, bounds-checked by parse() up to the exponent header, which
 * follows the SwitchML header; the payload (k int32) follows the exponent header. */
struct agg_pkt {
	struct ethhdr *eth;
	struct iphdr *ip;
	struct udphdr *udp;
	struct switchml_hdr *sml;
	struct exponents_hdr *exp;
	/* ctx->data_end as parse() read it: later bounds checks compare against this copy, since
	 * clang may otherwise keep &ctx->data_end in a register, and the verifier refuses loads
	 * through a ctx pointer moved off its start ("dereference of modified ctx ptr") */
	void *data_end;
};

enum agg_parse {
	AGG_PARSE_NOT_OURS = -1, /* not IPv4 UDP to 0xBEE0..0xBEEF: pass it untouched */
	AGG_PARSE_OK = 0,	 /* ours, pk filled up to the exponent header */
	AGG_PARSE_MALFORMED,	 /* ours, with IPv4 options or as a first fragment */
	AGG_PARSE_TRUNCATED,	 /* ours, shorter than our two headers */
};

/* Fill pk with a frame's headers; false when our two headers do not fit before data_end. */
static __always_inline bool fill_pkt(struct agg_pkt *pk, struct ethhdr *eth, struct iphdr *ip,
				     struct udphdr *udp, void *data_end)
{
	pk->eth = eth;
	pk->ip = ip;
	pk->udp = udp;
	pk->sml = (void *)(udp + 1);
	pk->exp = (void *)(pk->sml + 1);
	pk->data_end = data_end;
	return (void *)(pk->exp + 1) <= data_end;
}

static __always_inline int parse(struct xdp_md *ctx, struct agg_pkt *pk)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	struct udphdr *udp;

	if ((void *)(ip + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP))
		return AGG_PARSE_NOT_OURS;
	if (ip->version != 4 || ip->protocol != IPPROTO_UDP || ip->ihl < 5)
		return AGG_PARSE_NOT_OURS;
	if (ip->frag_off & bpf_htons(AGG_IP_OFFSET_MASK))
		return AGG_PARSE_NOT_OURS; /* a later fragment has no UDP header to look at */
	if (ip->ihl != 5) {
		/* Options move the UDP header; look at its port at the real offset, bounded by the
		 * verifier-visible maximum of 15 words. */
		udp = (void *)ip + ((ip->ihl & 0xf) << 2);
		if ((void *)(udp + 1) > data_end ||
		    (udp->dest & bpf_htons(SML_UDP_PORT_MASK)) != bpf_htons(SML_UDP_PORT))
			return AGG_PARSE_NOT_OURS;
		return AGG_PARSE_MALFORMED;
	}
	udp = (void *)(ip + 1);
	if ((void *)(udp + 1) > data_end)
		return AGG_PARSE_NOT_OURS;
	if ((udp->dest & bpf_htons(SML_UDP_PORT_MASK)) != bpf_htons(SML_UDP_PORT))
		return AGG_PARSE_NOT_OURS;
	if (ip->frag_off & bpf_htons(AGG_IP_MF))
		return AGG_PARSE_MALFORMED; /* ours, but fragmented */
	if (!fill_pkt(pk, eth, ip, udp, data_end))
		return AGG_PARSE_TRUNCATED;
	return AGG_PARSE_OK;
}

/* A result on its way out, as a devmap egress program sees it: IPv4 without options, not a
 * fragment, UDP from 0xBEE0..0xBEEF (addressed by the ingress program: to a worker's port,
 * which may be any), both our headers present. Fills pk as parse() does. */
static __always_inline bool parse_result(struct xdp_md *ctx, struct agg_pkt *pk)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	struct udphdr *udp = (void *)(ip + 1);

	if ((void *)(udp + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP))
		return false;
	if (ip->version != 4 || ip->ihl != 5 || ip->protocol != IPPROTO_UDP ||
	    (ip->frag_off & bpf_htons(AGG_IP_MF | AGG_IP_OFFSET_MASK)))
		return false;
	if ((udp->source & bpf_htons(SML_UDP_PORT_MASK)) != bpf_htons(SML_UDP_PORT))
		return false;
	return fill_pkt(pk, eth, ip, udp, data_end);
}

/* Point pk at the headers of a frame parse() took as ours again (false: the frame ends before
 * the exponents): IPv4 without options. verifier: packet pointers do not survive a helper that
 * changes the frame (bpf_xdp_adjust_tail) nor cross into a global function (sparse.h
 * agg_sparse, aggregate.h agg_jumbo); and pointers re-made with the same range check make one
 * state of the different kinds of sparse packets, whose payload checks left their pointers with
 * different ranges. */
static __always_inline bool repoint(struct xdp_md *ctx, struct agg_pkt *pk)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);

	return fill_pkt(pk, eth, ip, (void *)(ip + 1), data_end);
}

#endif
