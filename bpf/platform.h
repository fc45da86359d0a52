/* What the code needs of its toolchain: clang -target bpf -g -O2 at build time
 * (xdp_switch/bpfbuild.py), libbpf at load (xdp_switch/objload.py): libbpf's helper declarations,
 * BTF-defined maps in SEC(".maps"), real bpf_loop callbacks, sizes set before load
 * (consts.h agg_pool_slots). */
#ifndef XDP_AGG_PLATFORM_H
#define XDP_AGG_PLATFORM_H

#include <stdbool.h>
#include <stddef.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

typedef __u8 u8;
typedef __u16 u16;
typedef __u32 u32;
typedef __u64 u64;
typedef __s32 s32;
typedef __s8 s8;

/* One line per map: BTF-defined, created by libbpf; max_entries of the pool-sized ones and the
 * cpumap is set before load (xdp_switch/objload.py MAP_SIZES). */
#define AGG_BTF_MAP(kind, name, k, v, n) \
	struct {                         \
		__uint(type, kind);      \
		__type(key, k);          \
		__type(value, v);        \
		__uint(max_entries, n);  \
	} name SEC(".maps")
#define AGG_ARRAY(name, v, n)	     AGG_BTF_MAP(BPF_MAP_TYPE_ARRAY, name, u32, v, n)
#define AGG_HASH(name, k, v, n)	     AGG_BTF_MAP(BPF_MAP_TYPE_HASH, name, k, v, n)
#define AGG_PERCPU_ARRAY(name, v, n) AGG_BTF_MAP(BPF_MAP_TYPE_PERCPU_ARRAY, name, u32, v, n)
#define AGG_DEVMAP(name, n)	     AGG_BTF_MAP(BPF_MAP_TYPE_DEVMAP, name, u32, struct bpf_devmap_val, n)
#define AGG_DEVMAP_HASH(name, n) \
	AGG_BTF_MAP(BPF_MAP_TYPE_DEVMAP_HASH, name, u32, struct bpf_devmap_val, n)
#define AGG_CPU_MAP(name, n) AGG_BTF_MAP(BPF_MAP_TYPE_CPUMAP, name, u32, struct bpf_cpumap_val, n)
/* An array of devmaps (job_copies): the inner map is the shape every job's devmap has. */
#define AGG_ARRAY_OF_DEVMAPS(name, n, inner_n)                        \
	struct {                                                      \
		__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);             \
		__type(key, u32);                                     \
		__uint(max_entries, n);                               \
		__array(                                              \
			values, struct {                              \
				__uint(type, BPF_MAP_TYPE_DEVMAP);    \
				__type(key, u32);                     \
				__type(value, struct bpf_devmap_val); \
				__uint(max_entries, inner_n);         \
			});                                           \
	} name SEC(".maps")

/* A program's ELF section, which tells libbpf its type, expected attach type and flags. */
#define AGG_PROG(sec) SEC(sec)
#ifdef AGG_FRAGS
#define AGG_SEC_XDP    "xdp.frags"
#define AGG_SEC_DEVMAP "xdp.frags/devmap"
#define AGG_SEC_CPUMAP "xdp.frags/cpumap"
#else
#define AGG_SEC_XDP    "xdp"
#define AGG_SEC_DEVMAP "xdp/devmap"
#define AGG_SEC_CPUMAP "xdp/cpumap"
#endif

#endif
