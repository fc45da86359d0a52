/* configuration.p4: sizes of the v1model (bmv2) aggregator. */
#ifndef _XDP_AGG_CONFIGURATION_P4_
#define _XDP_AGG_CONFIGURATION_P4_

// Slots in the pool shared by all jobs; each slot has two versions (shadow copies), so every
// per-slot register has 2 * POOL_SLOTS entries, indexed slot * 2 + version. The control plane
// (xdp_agg/targets/bmv2/backend.py) refuses job ranges past it. Override with -DPOOL_SLOTS=N.
#ifndef POOL_SLOTS
#define POOL_SLOTS 1024
#endif
const bit<32> POOL_ENTRIES = 2 * POOL_SLOTS;

// Multicast group 1 floods plain traffic to every port; job j's results use group j + 2
// (the control plane creates both; see bmv2_backend.FLOOD_MGID and job_mgid()).
const bit<16> FLOOD_MGID = 1;

// The egress port every folded (256-element) packet goes to between its passes: no interface's
// (the control plane numbers interfaces from 0, bmv2's drop port is 511). It never leaves there
// (egress recirculates it); one port for all of them means one egress queue, so the passes of
// any two folded packets stay in the order their first passes had (a later pass of a round's
// first contribution overwrites, and the completing one must come after the others). The
// control plane deepens its queue (bmv2_backend.FOLD_QUEUE_DEPTH).
const bit<9> FOLD_PORT = 510;

// Table sizes.
const bit<32> WORKERS_TABLE_SIZE = 4096; // (IPv4 source, UDP destination port) -> job, worker
const bit<32> L2_TABLE_SIZE = 1024; // static MAC table

#endif
