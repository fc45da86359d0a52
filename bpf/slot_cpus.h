/* One CPU per slot (attach --slot-cpus cpumap; docs/design.md "One CPU per slot").
 *
 * Where the NIC's receive hash cannot put every packet of a slot on one CPU (veth, NICs whose
 * hash fields cannot be set), the packets of a slot land on several CPUs, each adds into its own
 * partial, and the completing CPU gathers the others' (aggregate.h). Built with -DAGG_CPUMAP,
 * the program is split in two instead:
 *  - xdp_agg_steer, attached to the interfaces, parses a frame and redirects one of ours through
 *    the cpumap `cpu_map` to the CPU that owns its slot (`slot_cpu`, filled by the control plane,
 *    xdp_switch/slot_cpus.py); anything else passes, untouched, on the CPU it came in on;
 *  - xdp_agg_ingress, loaded with expected attach type BPF_XDP_CPUMAP and put on every entry of
 *    `cpu_map`, aggregates there, unchanged: every contribution of a slot is on one CPU, so the
 *    completing packet finds all n in its own partial and gathers nothing.
 * A cpumap program cannot XDP_TX (kernel/bpf/cpumap.c, cpu_map_bpf_prog_run_xdp: PASS, DROP and
 * REDIRECT only), so what aggregate.h sends back out of the interface it came in on leaves by
 * a redirect to that interface (AGG_TX); the switch topology's devmap broadcast is a redirect
 * already. Correctness does not rest on the steering: a slot whose packets still reach two CPUs
 * (its table entry changed mid-round, a tree job's parent results, which carry the parent's slot
 * numbers) is merged as before. */
#ifndef XDP_AGG_SLOT_CPUS_H
#define XDP_AGG_SLOT_CPUS_H

#ifdef AGG_CPUMAP
#define AGG_CPUMAP_SLOTS (SML_POOL_SLOT_MASK + 1) /* every slot number the wire can carry */
/* clang-format off */
AGG_ARRAY(slot_cpu, u32, AGG_CPUMAP_SLOTS);                                       /* wire slot -> CPU */
AGG_CPU_MAP(cpu_map, AGG_NR_CPUS);                                                /* CPU -> queue, program */
/* clang-format on */

/* ifindex -> the interface, with the attachment's devmap egress program (xdp_agg_copy one-arm,
 * xdp_agg_egress in the switch topology): filled by attach. */
AGG_DEVMAP_HASH(tx_self, AGG_MAX_PORTS); /* ifindex -> the interface, its egress program */

/* A frame sent back out of the interface it came in on, through tx_self, so that it carries the
 * same egress program as the broadcasts out of that interface: a CPU's redirected frames to one
 * device wait in one bulk queue, which runs the program of its first frame on all of them
 * (kernel 6.18 kernel/bpf/devmap.c bq_enqueue), so a frame without one (bpf_redirect) ahead of
 * a broadcast's copies would send them unaddressed. The egress programs pass what is not theirs
 * to address unchanged. A missing entry: the low bits of the flags, XDP_ABORTED. */
#define AGG_TX(ctx) bpf_redirect_map(&tx_self, (ctx)->ingress_ifindex, XDP_ABORTED)

AGG_PROG(AGG_SEC_XDP) int xdp_agg_steer(struct xdp_md *ctx)
{
	struct agg_pkt pk;
	u32 g = 0, *cpu;

	switch (parse(ctx, &pk)) {
	case AGG_PARSE_NOT_OURS:
		return not_ours(ctx); /* forwarded on the CPU it came in on (forward.h) */
	case AGG_PARSE_OK:
		g = agg_ntohs(pk.sml->pool_index) & SML_POOL_SLOT_MASK;
		break;
	default:
		break; /* malformed or truncated: slot 0's CPU drops and counts it */
	}
	cpu = bpf_map_lookup_elem(&slot_cpu, &g);
	if (!cpu)
		return XDP_ABORTED;
	/* the control plane names only CPUs it put in cpu_map; one it did not: the frame is
	 * dropped (the flags' low bits are the action when the entry is missing) */
	return bpf_redirect_map(&cpu_map, *cpu, XDP_DROP);
}
#else
#define AGG_TX(ctx) XDP_TX
#endif

#endif
