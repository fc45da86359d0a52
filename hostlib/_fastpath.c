/*
 * hostlib._fastpath: the native per-packet loop of the host library, its Python type.
 *
 * The numpy loop (hostlib/numpy_dense.py, run by hostlib.engine.StreamEngine) is the reference:
 * it moves one all-reduce as a self-clocked stream of packets with numpy, and pays tens of
 * microseconds of interpreter and numpy call overhead per batch. This module runs the same
 * stream in C with the GIL released: one Engine.allreduce() call builds the packets in place
 * (headers, quantise or byte-swap into the slot rows), sends them with sendmmsg + UDP GSO,
 * receives with recvmmsg (+ UDP GRO), validates and deduplicates the results, writes them into
 * the output, runs the per-packet timers (RFC 6298 estimate, Karn's rule, exponential back-off)
 * and a congestion window (AIMD), and returns when the all-reduce is done or stalled. It sends
 * exactly the bytes the numpy engine sends (tests/unit/test_fastpath.py compares them).
 *
 * The units, each with its header: fp_kernels (payload conversion, AVX2 or scalar), fp_io (the
 * Transport: kernel UDP or AF_XDP, hostlib/_xsk.c), fp_run.h (the Stream, the Run and RoundOps,
 * a round strategy: what the loop and the strategies share), fp_loop (the stream loop), the two
 * strategies it runs, fp_dense (chunks) and fp_sparse (a sparse all-reduce's rounds,
 * docs/protocol.md section 8), and this file, the Python type and module: it picks the
 * strategy of each call, and is the only unit that names both. fp_wire.h is generated from
 * xdp_agg/proto/wire.py (python -m xdp_agg.codegen); the module exports its constants and their
 * names (WIRE), and hostlib.native_stream refuses to import a build whose constants differ from
 * xdp_agg.proto.wire's.
 * (The wire layout, p4app-switchML's, is docs/protocol.md's; fp_run.h fp_header, fp_dense.c
 * dense_fill, fp_sparse.c sparse_fill.)
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <arpa/inet.h>
#include <linux/if_link.h>
#include <math.h>
#include <string.h>
#include <unistd.h>

#include "fp_counters.h"
#include "fp_dense.h"
#include "fp_io.h"
#include "fp_kernels.h"
#include "fp_loop.h"
#include "fp_sparse.h"
#include "fp_wire.h"
#include "xsk_prog.h"

typedef struct {
    PyObject_HEAD Stream stream; /* all of the loop's state: one per Engine, no globals */
    int ready;                   /* stream set up (Engine_init succeeded) */
    char xsk_why[320];    /* why AF_XDP was asked for and is not used ("" if it is or was not) */
    char closed_path[64]; /* the data path it had, once closed (stream.t NULL); "" before */
} Engine;

static void Engine_dealloc(Engine *e)
{
    if (e->ready)
        fp_stream_free(&e->stream);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

/* The AF_XDP transport over udp (*t) from spec, a dict of XskConfig's fields by name
 * (hostlib.afxdp.spec; mode "drv", "skb" or ""). -1 with a Python error on a bad spec; else 0,
 * *t the AF_XDP transport, or still udp with the reason in e->xsk_why. */
static int open_xsk(Engine *e, PyObject *spec, const struct sockaddr_in *dst, Transport **t)
{
    static char *kwlist[] = {"ifindex",  "queue", "src_mac", "dst_mac",  "src_ip",
                             "src_port", "ttl",   "tos",     "zerocopy", "mode",
                             "lane",     "lanes", NULL};
    XskConfig c;
    memset(&c, 0, sizeof c);
    const char *smac, *dmac, *sip, *mode;
    Py_ssize_t slen, dlen;
    int sport;
    PyObject *none = PyTuple_New(0);
    int ok = none && PyDict_Check(spec) &&
             PyArg_ParseTupleAndKeywords(none, spec, "$iiy#y#siiipsii", kwlist, &c.ifindex,
                                         &c.queue, &smac, &slen, &dmac, &dlen, &sip, &sport, &c.ttl,
                                         &c.tos, &c.zerocopy, &mode, &c.lane, &c.lanes);
    Py_XDECREF(none);
    if (!ok) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "xsk: a dict of XskConfig's fields by name");
        return -1;
    }
    struct in_addr a;
    if (slen != 6 || dlen != 6 || inet_pton(AF_INET, sip, &a) != 1 || sport < 1 || sport > 65535) {
        PyErr_SetString(PyExc_ValueError, "xsk: bad MAC, address or port");
        return -1;
    }
    memcpy(c.src_mac, smac, 6);
    memcpy(c.dst_mac, dmac, 6);
    c.src_ip = ntohl(a.s_addr);
    c.dst_ip = ntohl(dst->sin_addr.s_addr);
    c.src_port = (uint16_t)sport;
    c.dst_port = ntohs(dst->sin_port);
    c.plen = (*t)->plen;
    c.prog_flags = strcmp(mode, "drv") == 0   ? XDP_FLAGS_DRV_MODE
                   : strcmp(mode, "skb") == 0 ? XDP_FLAGS_SKB_MODE
                                              : 0;
    Transport *x = fp_xsk_open(*t, &c, 2 * e->stream.cfg.window, e->xsk_why, sizeof e->xsk_why);
    if (x)
        *t = x;
    return 0;
}

/* cfg->faults from faults = None or (send_loss, recv_loss, send_dup, recv_dup, seed). */
static int parse_faults(PyObject *faults, StreamConfig *cfg)
{
    cfg->faults = 0;
    if (faults == Py_None)
        return 0;
    unsigned long long seed;
    if (!PyArg_ParseTuple(faults, "ddddK", &cfg->send_loss, &cfg->recv_loss, &cfg->send_dup,
                          &cfg->recv_dup, &seed))
        return -1;
    cfg->faults = 1;
    cfg->seed = seed;
    return 0;
}

/* The data address host:port into dst. */
static int parse_address(const char *host, int port, struct sockaddr_in *dst)
{
    *dst = (struct sockaddr_in){.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, host, &dst->sin_addr) != 1) {
        PyErr_Format(PyExc_ValueError, "not an IPv4 address: %s", host);
        return -1;
    }
    return 0;
}

static int Engine_init(Engine *e, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {
        "fd",        "host",        "port", "elems",   "window",    "scaling_workers",
        "type_size", "slot_base",   "rto",  "rto_max", "gso",       "gro",
        "cwnd",      "faults",      "xsk",  "spin",    "wire_bits", "early_loss",
        "rto_floor", "queue_delay", NULL};
    StreamConfig c = {.k = -1,
                      .window = -1,
                      .scaling_workers = -1,
                      .slot_base = -1,
                      .rto_min = -1,
                      .rto_floor = 2e-3,
                      .queue_delay = 4e-3};
    const char *host = NULL, *cwnd = "aimd";
    int fd = -1, port = -1, type_size = -1, gso = 1, gro = 1, spin = 1, wire_bits = 32;
    int early_loss = 1;
    PyObject *faults = Py_None, *xsk = Py_None;
    if (PyTuple_GET_SIZE(args)) {
        PyErr_SetString(PyExc_TypeError, "Engine takes keyword arguments only");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$isiiiiiiddppsOOpipdd", kwlist, &fd, &host, &port,
                                     &c.k, &c.window, &c.scaling_workers, &type_size, &c.slot_base,
                                     &c.rto_min, &c.rto_max, &gso, &gro, &cwnd, &faults, &xsk,
                                     &spin, &wire_bits, &early_loss, &c.rto_floor, &c.queue_delay))
        return -1;
    if (fd < 0 || !host || c.k < 1 || c.window < 1 || c.scaling_workers < 1 || port < 0 ||
        port > 65535 || type_size < 0 || type_size > 255 || c.slot_base < 0 || c.rto_min <= 0 ||
        c.rto_max <= 0 || c.rto_floor <= 0 || c.queue_delay < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "Engine needs fd, host, port, elems, window, scaling_workers, type_size, "
                        "slot_base, rto, rto_max, rto_floor and queue_delay, each in range");
        return -1;
    }
    if (wire_bits != 32 && wire_bits != 16) {
        PyErr_Format(PyExc_ValueError, "wire_bits must be 32 or 16, not %d", wire_bits);
        return -1;
    }
    c.pairs = wire_bits == 16;
    c.row_extra = FP_SPARSE_HLEN; /* the longest packet: a sparse one with data */
    c.type_size = (uint8_t)type_size;
    c.spin = spin;
    c.early_loss = early_loss;
    if (strcmp(cwnd, "aimd") != 0 && strcmp(cwnd, "fixed") != 0) {
        PyErr_Format(PyExc_ValueError, "cwnd must be 'aimd' or 'fixed', not %s", cwnd);
        return -1;
    }
    c.cwnd_fixed = strcmp(cwnd, "fixed") == 0;
    struct sockaddr_in dst;
    if (parse_faults(faults, &c) < 0 || parse_address(host, port, &dst) < 0)
        return -1;
    if (e->ready) { /* __init__ called again: start over */
        fp_stream_free(&e->stream);
        e->ready = 0;
    }
    e->xsk_why[0] = 0;
    e->closed_path[0] = 0;
    e->stream.cfg = c; /* open_xsk reads the window */
    Transport *t = fp_udp_open(fd, &dst, FP_VALUES_AT + 4 * c.k, 2 * c.window, gso, gro);
    if (!t) {
        PyErr_NoMemory();
        return -1;
    }
    if (xsk != Py_None && open_xsk(e, xsk, &dst, &t) < 0) {
        t->ops->close(t);
        return -1;
    }
    if (fp_stream_init(&e->stream, &c, t) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    e->ready = 1;
    return 0;
}

static int get_buffer(PyObject *o, Py_buffer *b, int writable)
{
    return PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0));
}

/* The counters as a dict, by the names of FP_COUNTERS. */
static PyObject *counters_dict(const Counters *c)
{
    PyObject *d = PyDict_New();
#define FP_COUNTER_ITEM(name)                               \
    if (d) {                                                \
        PyObject *x = PyLong_FromUnsignedLongLong(c->name); \
        if (!x || PyDict_SetItemString(d, #name, x) < 0)    \
            Py_CLEAR(d);                                    \
        Py_XDECREF(x);                                      \
    }
    FP_COUNTERS(FP_COUNTER_ITEM)
#undef FP_COUNTER_ITEM
    return d;
}

/* The loop's hooks (they take the GIL): the progress callback, and signal handlers. */
typedef struct {
    PyObject *progress;
    PyThreadState *ts;
} Hooks;

static int call_progress(void *ctx, int64_t ndone, uint64_t retransmissions)
{
    Hooks *hk = ctx;
    PyEval_RestoreThread(hk->ts);
    PyObject *res = PyObject_CallFunction(hk->progress, "LK", (long long)ndone,
                                          (unsigned long long)retransmissions);
    Py_XDECREF(res);
    hk->ts = PyEval_SaveThread();
    return res == NULL;
}

static int check_signals(void *ctx)
{
    Hooks *hk = ctx;
    PyEval_RestoreThread(hk->ts);
    int bad = PyErr_CheckSignals();
    hk->ts = PyEval_SaveThread();
    return bad;
}

/* The element type named `name` (hostlib.engine DTYPES): FP_I32 .. FP_F16, or -1 with a
 * ValueError. */
static int parse_dtype(const char *name)
{
    static const char *names[] = {"int32", "float32", "bfloat16", "float16"};
    for (int i = 0; i < 4; i++)
        if (strcmp(name, names[i]) == 0)
            return i; /* FP_I32, FP_F32, FP_BF16, FP_F16 in this order */
    PyErr_Format(PyExc_ValueError, "dtype must be int32, float32, bfloat16 or float16, not %s",
                 name);
    return -1;
}

/* The element type of a run on stream st, or -1 with a ValueError: int32 only at 32 bits. */
static int run_dtype(const Stream *st, const char *name)
{
    int dt = parse_dtype(name);
    if (dt == FP_I32 && st->cfg.pairs) {
        PyErr_SetString(PyExc_ValueError, "int32 is exact only at 32 bits: not on a 16-bit job");
        return -1;
    }
    return dt;
}

PyDoc_STRVAR(
    Engine_allreduce_doc,
    "allreduce(dtype, src, dst, P, w, job_number, versions, exponents, timeout,\n"
    "          progress=None, progress_every=1.0) -> dict\n\n"
    "Run the stream of one all-reduce with the GIL released. dtype: 'int32', 'float32',\n"
    "'bfloat16' or 'float16' (a 16-bit job: not int32); src and dst are contiguous buffers of L\n"
    "elements of it (dst may be src), quantised from and dequantised into that type directly;\n"
    "P packets over w slots; versions: the next version of each slot (bytes, >= w); exponents:\n"
    "float only, the e0 of each chunk of a packet's elements (int8 bytes, see chunk_exponents).\n"
    "progress(ndone, retransmissions) is called every progress_every s.\n"
    "Returns {'status': 'done' | 'stalled', 'ndone', 'results_here', 'busy' (slot offsets with\n"
    "a packet in flight), 'counters' (this call's), 'gso_refused', 'last_errno'}; raises OSError\n"
    "on a socket error that is neither transient nor a GSO refusal.");

/* allreduce's answer for run r, which fp_run_loop ended with rc (ST_DONE, or stalled). */
static PyObject *run_result(const Stream *st, const Run *r, int rc)
{
    PyObject *result = NULL, *busy = PyList_New(0);
    for (int64_t s = 0; busy && s < r->w; s++) {
        if (st->deadline[s] < INFINITY) {
            PyObject *x = PyLong_FromLongLong(s);
            if (!x || PyList_Append(busy, x) < 0)
                Py_CLEAR(busy);
            Py_XDECREF(x);
        }
    }
    PyObject *cd = counters_dict(&r->c);
    const char *status = rc == ST_DONE ? "done" : rc == ST_STALLED ? "stalled" : "bad_next";
    if (busy && cd)
        result = Py_BuildValue(
            "{s:s,s:L,s:L,s:O,s:O,s:O,s:i}", "status", status, "ndone", (long long)r->ndone,
            "results_here", (long long)r->results_here, "busy", busy, "counters", cd, "gso_refused",
            st->t->gso_refused ? Py_True : Py_False, "last_errno", st->t->last_errno);
    Py_XDECREF(busy);
    Py_XDECREF(cd);
    return result;
}

/* Run r on e's stream with the GIL released: fp_run_start (whose strategy's start, for a sparse
 * run, zeroes the output and finds the columns: O(L), so without the GIL too) and the loop. The
 * result dict, or NULL with an exception (OSError for -errno). */
static PyObject *run_released(Engine *e, Run *r, double timeout, PyObject *progress, double every)
{
    Stream *st = &e->stream;
    if (!st->t) {
        PyErr_SetString(PyExc_ValueError, "the engine is closed");
        return NULL;
    }
    Hooks hk = {.progress = progress, .ts = PyEval_SaveThread()};
    LoopHooks h = {progress != Py_None ? call_progress : NULL, check_signals, &hk, every};
    fp_run_start(r, st);
    st->t->gso_refused = 0;
    int rc = fp_run_loop(r, timeout, &h);
    PyEval_RestoreThread(hk.ts);
    PyObject *result = NULL;
    if (rc == -EINTR && PyErr_Occurred()) {
        /* the hook's exception */
    } else if (rc < 0) {
        errno = -rc;
        PyErr_SetFromErrno(PyExc_OSError);
    } else {
        result = run_result(st, r, rc);
    }
    fp_run_end(r);
    return result;
}

/* A run of the strategy `round` (its state rs) of type dt, from src into dst (of the same
 * length): P packets over w slots, as job number jn, versions the next version of each slot at
 * the start; the rest of it zero, for fp_run_start. */
static Run new_run(const RoundOps *round, void *rs, int dt, const Py_buffer *src,
                   const Py_buffer *dst, int64_t P, int64_t w, int jn, const Py_buffer *vers)
{
    return (Run){.round = round,
                 .rs = rs,
                 .is_float = dt != FP_I32,
                 .dtype = dt,
                 .src = src->buf,
                 .dst = dst->buf,
                 .L = src->len / fp_dtype_size(dt),
                 .P = P,
                 .w = w,
                 .jn = (uint8_t)jn,
                 .versions = vers->buf};
}

/* allreduce's chunks: Pd, or -1 with a ValueError when the buffers, P, w or versions are not
 * those of a run of type dt on stream st. */
static int64_t dense_chunks(const Stream *st, int dt, const Py_buffer *src, const Py_buffer *dst,
                            long long P, long long w, const Py_buffer *vers)
{
    Py_ssize_t size = fp_dtype_size(dt), L = src->len / size;
    int64_t Pd = (L + st->ke - 1) / st->ke;
    int is_float = dt != FP_I32;
    if (dst->len != src->len || src->len % size || w < 1 || w > st->cfg.window || vers->len < w ||
        P != (is_float ? Pd + w : Pd) || w > Pd) {
        PyErr_SetString(PyExc_ValueError, "allreduce: inconsistent P, w, buffers or versions");
        return -1;
    }
    return Pd;
}

static PyObject *Engine_allreduce(Engine *e, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"dtype",          "src",      "dst",       "P",       "w",
                             "job_number",     "versions", "exponents", "timeout", "progress",
                             "progress_every", NULL};
    int jn, dt;
    const char *dtype;
    long long P, w;
    PyObject *src_o, *dst_o, *exps_o, *progress = Py_None;
    Py_buffer src = {0}, dst = {0}, vers, exps = {0}; /* released whether got (.obj) or not */
    double timeout, progress_every = 1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sOOLLiy*Od|Od", kwlist, &dtype, &src_o, &dst_o, &P,
                                     &w, &jn, &vers, &exps_o, &timeout, &progress, &progress_every))
        return NULL;
    PyObject *result = NULL;
    uint8_t *done = NULL;
    int8_t *agreed = NULL;
    Stream *st = &e->stream;
    int64_t Pd = -1;
    if ((dt = run_dtype(st, dtype)) < 0 || get_buffer(src_o, &src, 0) < 0 ||
        get_buffer(dst_o, &dst, 1) < 0 || (Pd = dense_chunks(st, dt, &src, &dst, P, w, &vers)) < 0)
        goto out;
    int is_float = dt != FP_I32;
    if (is_float) {
        if (PyObject_GetBuffer(exps_o, &exps, PyBUF_C_CONTIGUOUS) < 0)
            goto out;
        if (exps.len < Pd) {
            PyErr_SetString(PyExc_ValueError, "allreduce: fewer exponents than chunks");
            goto out;
        }
        agreed = PyMem_RawCalloc((size_t)Pd + 1, 1);
    }
    done = PyMem_RawCalloc((size_t)P + 1, 1);
    if (!done || (is_float && !agreed)) {
        PyErr_NoMemory();
        goto out;
    }
    DenseRun dense = {.Pd = Pd, .exps = is_float ? exps.buf : NULL, .agreed = agreed};
    Run r = new_run(&fp_dense_rounds, &dense, dt, &src, &dst, P, w, jn, &vers);
    r.state = done;
    result = run_released(e, &r, timeout, progress, progress_every);
out:
    PyMem_RawFree(done);
    PyMem_RawFree(agreed);
    PyBuffer_Release(&exps); /* nothing for a buffer not got: its obj is NULL */
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&vers);
    return result;
}

PyDoc_STRVAR(
    Engine_allreduce_sparse_doc,
    "allreduce_sparse(dtype, src, dst, w, job_number, versions, nonzero, exponents, rounds,\n"
    "                 timeout, progress=None, progress_every=1.0, pad_empty=False) -> dict\n\n"
    "Run one sparse all-reduce (docs/protocol.md section 8) with the GIL released: src and dst\n"
    "as for allreduce, B blocks of a packet's elements over w slots; nonzero and exponents:\n"
    "block_scan's "
    "(exponents None for int32); rounds: a writable buffer of w int64, set to the rounds each\n"
    "slot ran (also when it fails: the versions advance by them). Returns allreduce's dict, with\n"
    "status 'bad_next' when a result would skip this worker's data, and 'union_blocks' (results\n"
    "with data) and 'bad' (None, or (slot offset, block, its result's next, this worker's next)).\n"
    "pad_empty: empty contributions carry k zero int32 (JobSpec.pad_empty).");

/* The sparse parts of allreduce_sparse's answer: union_blocks, bad. */
static PyObject *sparse_result(PyObject *result, const SparseRun *sp, int failed)
{
    PyObject *bad = failed
                        ? Py_BuildValue("(LLLL)", (long long)sp->bad_slot, (long long)sp->bad_from,
                                        (long long)sp->bad_to, (long long)sp->bad_mine)
                        : Py_NewRef(Py_None);
    PyObject *u = PyLong_FromLongLong(sp->union_blocks);
    if (!bad || !u || PyDict_SetItemString(result, "bad", bad) < 0 ||
        PyDict_SetItemString(result, "union_blocks", u) < 0)
        Py_CLEAR(result);
    Py_XDECREF(bad);
    Py_XDECREF(u);
    return result;
}

/* allreduce_sparse's buffers consistent with B blocks of the stream's k and w slots? */
static int sparse_args_ok(const Stream *st, const Py_buffer *src, const Py_buffer *dst,
                          const Py_buffer *vers, const Py_buffer *nz, const Py_buffer *exps,
                          const Py_buffer *rounds, long long w, int dt)
{
    Py_ssize_t size = fp_dtype_size(dt), L = src->len / size, B = (L + st->ke - 1) / st->ke;
    int is_float = dt != FP_I32;
    return dst->len == src->len && src->len % size == 0 && L > 0 && (int64_t)B < 0xFFFFFFFFll &&
           w >= 1 && w <= st->cfg.window && w <= B && vers->len >= w && nz->len == B &&
           (!is_float || exps->len >= B) && rounds->len >= (Py_ssize_t)(8 * w);
}

static PyObject *Engine_allreduce_sparse(Engine *e, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {
        "dtype",     "src",    "dst",     "w",        "job_number",     "versions",  "nonzero",
        "exponents", "rounds", "timeout", "progress", "progress_every", "pad_empty", NULL};
    int jn, pad = 0, dt, is_float;
    const char *dtype;
    long long w;
    PyObject *src_o, *dst_o, *nz_o, *exps_o, *rounds_o, *progress = Py_None;
    Py_buffer src = {0}, dst = {0}, vers, nz = {0}, exps = {0}, rounds = {0};
    double timeout, progress_every = 1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sOOLiy*OOOd|Odp", kwlist, &dtype, &src_o, &dst_o,
                                     &w, &jn, &vers, &nz_o, &exps_o, &rounds_o, &timeout, &progress,
                                     &progress_every, &pad))
        return NULL;
    PyObject *result = NULL;
    SparseRun sp = {0};
    Stream *st = &e->stream;
    Run r = {0};
    if ((dt = run_dtype(st, dtype)) < 0)
        goto out;
    is_float = dt != FP_I32;
    if (get_buffer(src_o, &src, 0) < 0 || get_buffer(dst_o, &dst, 1) < 0 ||
        get_buffer(nz_o, &nz, 0) < 0 || get_buffer(rounds_o, &rounds, 1) < 0 ||
        (is_float && get_buffer(exps_o, &exps, 0) < 0))
        goto out;
    if (!sparse_args_ok(st, &src, &dst, &vers, &nz, &exps, &rounds, w, dt)) {
        PyErr_SetString(PyExc_ValueError, "allreduce_sparse: inconsistent w, buffers or versions");
        goto out;
    }
    int64_t B = nz.len, P = fp_sparse_packets(B, w, is_float);
    sp.nonzero = nz.buf;
    sp.exps = is_float ? exps.buf : NULL;
    sp.rounds = rounds.buf;
    sp.pad = pad;
    r = new_run(&fp_sparse_rounds, &sp, dt, &src, &dst, P, w, jn, &vers);
    if (fp_sparse_alloc(&sp, B, w) < 0 || !(r.state = PyMem_RawCalloc((size_t)P, 1))) {
        PyErr_NoMemory();
        goto out;
    }
    result = run_released(e, &r, timeout, progress, progress_every);
    if (result)
        result = sparse_result(result, &sp, r.fail == ST_REFUSED);
out:
    fp_sparse_free(&sp);
    PyMem_RawFree(r.state);
    PyBuffer_Release(&rounds);
    PyBuffer_Release(&exps);
    PyBuffer_Release(&nz);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&vers);
    return result;
}

static PyObject *Engine_get_srtt(Engine *e, void *c)
{
    (void)c;
    return PyFloat_FromDouble(e->stream.cc.have_rtt ? e->stream.cc.srtt : 0.0);
}

static PyObject *Engine_get_min_rtt(Engine *e, void *c)
{
    (void)c;
    return PyFloat_FromDouble(e->stream.cc.have_rtt ? e->stream.cc.min_rtt : 0.0);
}

static PyObject *Engine_get_cwnd(Engine *e, void *c)
{
    (void)c;
    return PyFloat_FromDouble(e->stream.cc.cwnd);
}

static PyObject *Engine_get_gso(Engine *e, void *c)
{
    (void)c;
    return PyBool_FromLong(e->ready && e->stream.t && e->stream.t->gso);
}

static PyObject *Engine_get_data_path(Engine *e, void *c)
{
    char name[64] = "udp";
    (void)c;
    if (e->closed_path[0])
        return PyUnicode_FromString(e->closed_path);
    if (e->ready)
        e->stream.t->ops->describe(e->stream.t, name, sizeof name);
    return PyUnicode_FromString(name);
}

static PyObject *Engine_get_xsk_reason(Engine *e, void *c)
{
    (void)c;
    return PyUnicode_FromString(e->xsk_why);
}

static PyGetSetDef Engine_getset[] = {
    {"srtt", (getter)Engine_get_srtt, NULL, "smoothed round trip, s (0 before a sample)", NULL},
    {"min_rtt", (getter)Engine_get_min_rtt, NULL, "least round trip sampled, s (0 before one)",
     NULL},
    {"cwnd", (getter)Engine_get_cwnd, NULL, "congestion window, packets", NULL},
    {"gso", (getter)Engine_get_gso, NULL, "whether sends still use UDP GSO", NULL},
    {"data_path", (getter)Engine_get_data_path, NULL,
     "'udp' (the kernel socket), or 'afxdp-copy-drv' / 'afxdp-zerocopy-drv' / 'afxdp-copy-skb'",
     NULL},
    {"xsk_reason", (getter)Engine_get_xsk_reason, NULL,
     "why AF_XDP was asked for and could not run ('' when it runs or was not asked for)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Engine_close_doc,
             "close()\n\n"
             "Release the data path (not during an all-reduce): the AF_XDP socket, whose port's "
             "results go to the kernel socket from then while the queue's other AF_XDP sockets "
             "(other lanes and jobs) go on, and the buffers; not the kernel socket `fd`, which "
             "its owner closes after. data_path and srtt stay readable; an all-reduce raises "
             "ValueError. Idempotent.");

static PyObject *Engine_close(Engine *e, PyObject *noargs)
{
    (void)noargs;
    Transport *t = e->ready ? e->stream.t : NULL;
    if (t) {
        t->ops->describe(t, e->closed_path, sizeof e->closed_path);
        e->stream.t = NULL;
        t->ops->close(t);
    }
    Py_RETURN_NONE;
}

static PyMethodDef Engine_methods[] = {
    {"close", (PyCFunction)Engine_close, METH_NOARGS, Engine_close_doc},
    {"allreduce", (PyCFunction)(void (*)(void))Engine_allreduce, METH_VARARGS | METH_KEYWORDS,
     Engine_allreduce_doc},
    {"allreduce_sparse", (PyCFunction)(void (*)(void))Engine_allreduce_sparse,
     METH_VARARGS | METH_KEYWORDS, Engine_allreduce_sparse_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(
    Engine_doc,
    "Engine(*, fd, host, port, elems, window, scaling_workers, type_size, slot_base, rto,\n"
    "       rto_max, gso=True, gro=True, cwnd='aimd', faults=None, xsk=None, spin=True,\n"
    "       wire_bits=32, early_loss=True, rto_floor=0.002,\n"
    "       queue_delay=0.004)\n\n"
    "The native stream of one worker over its data socket `fd` (non-blocking UDP), sending to\n"
    "host:port. Keeps the RTT estimate, the congestion window and the buffers across\n"
    "all-reduces. faults: None or (send_loss, recv_loss, send_duplicate, recv_duplicate, seed).\n"
    "xsk: None, or {ifindex, queue, src_mac, dst_mac, src_ip, src_port, ttl, tos, zerocopy, mode,\n"
    "lane, lanes} (a dict, hostlib.afxdp.spec) to send and receive through an AF_XDP socket on\n"
    "that interface queue, lane `lane` of `lanes` sharing one UMEM there (hostlib/_xsk.c);\n"
    "where it cannot run, the kernel socket stays and xsk_reason says why. early_loss: resend\n"
    "a packet once later ones' results show it lost (docs/protocol.md 4.4), not only on its "
    "timer;\n"
    "rto_floor: then the least timer once round trips are measured. queue_delay: srtt this far\n"
    "above the least round trip means a queue: a loss then halves the congestion window.");

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hostlib._fastpath.Engine",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Engine_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
    .tp_getset = Engine_getset,
};

/* --- module functions (also the test entry points) ---------------------------------------- */
PyDoc_STRVAR(
    chunk_exponents_doc,
    "chunk_exponents(x, k, dtype='float32') -> (bytes, bad)\n\n"
    "scaling.chunk_exponents of the float buffer x (of dtype: float32, bfloat16 or float16) cut\n"
    "into chunks of k elements (the last one may be short): one int8 per chunk. bad is -1, or\n"
    "the index of the first NaN/Inf element.");

static PyObject *py_chunk_exponents(PyObject *m, PyObject *args)
{
    Py_buffer x;
    int k, dt;
    const char *dtype = "float32";
    (void)m;
    if (!PyArg_ParseTuple(args, "y*i|s", &x, &k, &dtype))
        return NULL;
    if ((dt = parse_dtype(dtype)) < 0 || dt == FP_I32 || k < 1 || x.len % fp_dtype_size(dt)) {
        PyBuffer_Release(&x);
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "chunk_exponents: k >= 1 and float data");
        return NULL;
    }
    Py_ssize_t L = x.len / fp_dtype_size(dt), chunks = (L + k - 1) / k;
    PyObject *out = PyBytes_FromStringAndSize(NULL, chunks);
    if (!out) {
        PyBuffer_Release(&x);
        return NULL;
    }
    fp_ssize bad;
    Py_BEGIN_ALLOW_THREADS bad = chunk_exponents(x.buf, dt, L, k, (int8_t *)PyBytes_AS_STRING(out));
    Py_END_ALLOW_THREADS PyBuffer_Release(&x);
    return Py_BuildValue("Nn", out, bad);
}

PyDoc_STRVAR(
    block_scan_doc,
    "block_scan(x, k, dtype) -> (nonzero, exponents, bad, count)\n\n"
    "A sparse all-reduce's look at its input x (of dtype: int32, float32, bfloat16 or float16)\n"
    "in blocks of k elements (the last one may be short): nonzero, one byte per block, 1 where\n"
    "it has a non-zero element; exponents, floats only (else None), one int8 per block as\n"
    "chunk_exponents; bad is -1 or the index of the first NaN/Inf element; count, the non-zero\n"
    "blocks. One pass, without the GIL.");

static PyObject *py_block_scan(PyObject *m, PyObject *args)
{
    Py_buffer x;
    int k, dt;
    const char *dtype;
    (void)m;
    if (!PyArg_ParseTuple(args, "y*is", &x, &k, &dtype))
        return NULL;
    PyObject *nz = NULL, *ex = NULL;
    if ((dt = parse_dtype(dtype)) < 0) {
        PyBuffer_Release(&x);
        return NULL;
    }
    int is_float = dt != FP_I32;
    Py_ssize_t L = x.len / fp_dtype_size(dt), B = k < 1 ? 0 : (L + k - 1) / k, count = 0;
    fp_ssize bad = -1;
    if (k < 1 || x.len % fp_dtype_size(dt)) {
        PyErr_SetString(PyExc_ValueError, "block_scan: k >= 1 and whole elements");
    } else if ((nz = PyBytes_FromStringAndSize(NULL, B)) &&
               (ex = is_float ? PyBytes_FromStringAndSize(NULL, B) : Py_NewRef(Py_None))) {
        uint8_t *n = (uint8_t *)PyBytes_AS_STRING(nz);
        int8_t *e = is_float ? (int8_t *)PyBytes_AS_STRING(ex) : NULL;
        Py_BEGIN_ALLOW_THREADS bad = block_scan(x.buf, dt, L, k, n, e);
        for (Py_ssize_t b = 0; b < B; b++)
            count += n[b];
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&x);
    if (!nz || !ex) {
        Py_XDECREF(nz);
        return NULL;
    }
    return Py_BuildValue("NNnn", nz, ex, (Py_ssize_t)bad, count);
}

/* What a test entry point's chunks are: k elements of dt, two a word when pairs, M. */
typedef struct {
    int k, dt, pairs;
    double M;
} ChunkShape;

/* One chunk of a test entry point: elements a..a+cnt-1 (words from a / (1 + pairs)) of in,
 * exponent E. */
typedef void (*chunk_fn)(const void *in, Py_ssize_t a, Py_ssize_t cnt, int8_t E,
                         const ChunkShape *sh, char *out);

/* The arguments of quantise and dequantise: (values, exponents, n, k[, dtype[, wire_bits]]):
 * v, ex, the shape; 0, or -1 with an exception (then v and ex are released). */
static int chunk_args(PyObject *args, const char *what, Py_buffer *v, Py_buffer *ex, ChunkShape *sh)
{
    int n, bits = 32;
    const char *dtype = "float32";
    if (!PyArg_ParseTuple(args, "y*y*ii|si", v, ex, &n, &sh->k, &dtype, &bits))
        return -1;
    sh->dt = parse_dtype(dtype);
    sh->pairs = bits == 16;
    if (sh->dt <= FP_I32 || n < 1 || sh->k < 1 || (bits != 32 && bits != 16) ||
        (sh->pairs && sh->k % 2)) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: bad arguments", what);
        PyBuffer_Release(v);
        PyBuffer_Release(ex);
        return -1;
    }
    sh->M = (double)((sh->pairs ? 32767 : 2147483647) / n);
    return 0;
}

/* quantise and dequantise: fn on each chunk of k elements of the values into new bytes
 * (`quant`: the values are elements of dt and out padded rows of words; else the values are
 * words and out their elements, the last chunk as long as its words). */
static PyObject *chunked_apply(PyObject *args, const char *what, int quant, chunk_fn fn)
{
    Py_buffer v, ex;
    ChunkShape sh;
    if (chunk_args(args, what, &v, &ex, &sh) < 0)
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t size = fp_dtype_size(sh.dt), per_word = sh.pairs ? 2 : 1;
    Py_ssize_t L = quant ? v.len / size : v.len / 4 * per_word;
    Py_ssize_t chunks = (L + sh.k - 1) / sh.k;
    Py_ssize_t bytes = quant ? chunks * sh.k / per_word * 4 : L * size;
    if (v.len % (quant ? size : 4) || ex.len < chunks)
        PyErr_Format(PyExc_ValueError, "%s: bad arguments", what);
    else if ((out = PyBytes_FromStringAndSize(NULL, bytes))) {
        memset(PyBytes_AS_STRING(out), 0, (size_t)bytes); /* quantise's padding */
        for (Py_ssize_t c = 0, a = 0; c < chunks; c++, a += sh.k)
            fn(v.buf, a, L - a < sh.k ? L - a : sh.k, ((const int8_t *)ex.buf)[c], &sh,
               PyBytes_AS_STRING(out));
    }
    PyBuffer_Release(&v);
    PyBuffer_Release(&ex);
    return out;
}

static void quantise_chunk(const void *in, Py_ssize_t a, Py_ssize_t cnt, int8_t E,
                           const ChunkShape *sh, char *out)
{
    quantise((const uint8_t *)in + a * fp_dtype_size(sh->dt), sh->dt, cnt, ldexp(sh->M, -(int)E),
             E == E_MAX, sh->M, sh->pairs, (uint8_t *)out + 4 * (a >> sh->pairs));
}

static void dequantise_chunk(const void *in, Py_ssize_t a, Py_ssize_t cnt, int8_t E,
                             const ChunkShape *sh, char *out)
{
    dequantise((const uint8_t *)in + 4 * (a >> sh->pairs), cnt, ldexp(sh->M, -(int)E), sh->pairs,
               sh->dt, out + a * fp_dtype_size(sh->dt));
}

/* The test entry point NAME(...) -> bytes, documented by DOC: chunked_apply of NAME_chunk. */
#define CHUNKED_ENTRY(NAME, QUANT, DOC)                         \
    PyDoc_STRVAR(NAME##_doc, DOC);                              \
    static PyObject *py_##NAME(PyObject *m, PyObject *args)     \
    {                                                           \
        (void)m;                                                \
        return chunked_apply(args, #NAME, QUANT, NAME##_chunk); \
    }

CHUNKED_ENTRY(
    quantise, 1,
    "quantise(x, exponents, scaling_workers, k, dtype='float32', wire_bits=32) -> bytes\n\n"
    "Test entry point: the big-endian int32 payload rows of the chunks of x (k elements\n"
    "of dtype each, the last zero-padded) quantised with their agreed exponents, one\n"
    "element a word or (wire_bits 16) two, as the loop builds them.")
CHUNKED_ENTRY(dequantise, 0,
              "dequantise(sums, exponents, scaling_workers, k, dtype='float32', wire_bits=32)\n"
              "-> bytes\n\n"
              "Test entry point: the elements (dtype, native order) of the big-endian int32 sums\n"
              "(rows of k elements: k words, or k / 2 at wire_bits 16) with their agreed\n"
              "exponents, as the loop writes them into the output.")
#undef CHUNKED_ENTRY

PyDoc_STRVAR(
    set_simd_doc,
    "set_simd(name) -> str\n\n"
    "Choose the kernels: 'avx2' (if the CPU has it) or 'scalar'; returns the previous choice.\n"
    "Both give identical bytes; tests use this to compare them. The default is the best the CPU\n"
    "offers; hostlib.native_stream applies XDP_AGG_SIMD (HostOptions' simd_from_env) at import.");

static PyObject *py_set_simd(PyObject *m, PyObject *args)
{
    const char *name;
    (void)m;
    if (!PyArg_ParseTuple(args, "s", &name))
        return NULL;
    const char *prev = fp_simd_avx2() ? "avx2" : "scalar";
    if (strcmp(name, "scalar") == 0) {
        fp_set_simd_avx2(0);
    } else if (strcmp(name, "avx2") == 0) {
        if (fp_set_simd_avx2(1) < 0) {
            PyErr_SetString(PyExc_ValueError, "this CPU has no AVX2");
            return NULL;
        }
    } else {
        PyErr_Format(PyExc_ValueError, "simd must be 'avx2' or 'scalar', not %s", name);
        return NULL;
    }
    return PyUnicode_FromString(prev);
}

static PyObject *py_simd(PyObject *m, PyObject *noargs)
{
    (void)m;
    (void)noargs;
    return PyUnicode_FromString(fp_simd_avx2() ? "avx2" : "scalar");
}

PyDoc_STRVAR(xsk_test_program_doc,
             "xsk_test_program(ports, queue) -> fd\n\n"
             "The AF_XDP data path's redirect program (hostlib/xsk_prog.c) for sockets on these "
             "UDP ports (port i in slot i) and queue, loaded with an empty XSKMAP and XDP_DROP "
             "where a slot has no socket, so that BPF_PROG_TEST_RUN tells a frame for a socket "
             "(drop) from one for the kernel (pass). The caller closes the fd.");

/* The list `ports` into the ports map ports_fd, port i to slot i; -1 with a Python error. */
static int test_ports(int ports_fd, PyObject *ports)
{
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ports); i++) {
        long port = PyLong_AsLong(PyList_GET_ITEM(ports, i));
        if (port == -1 && PyErr_Occurred())
            return -1;
        if (port < 1 || port > 65535) {
            PyErr_Format(PyExc_ValueError, "not a port: %ld", port);
            return -1;
        }
        if (xsk_map_set(ports_fd, (uint32_t)port, (int)i) < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
    }
    return 0;
}

static PyObject *py_xsk_test_program(PyObject *m, PyObject *args)
{
    PyObject *ports;
    int queue;
    char log[4096] = "";
    (void)m;
    if (!PyArg_ParseTuple(args, "O!i", &PyList_Type, &ports, &queue))
        return NULL;
    int n = (int)PyList_GET_SIZE(ports);
    if (n < 1 || n > FP_MAX_LANES || queue < 0)
        return PyErr_Format(PyExc_ValueError, "bad ports (1 to %d of them) or queue %d",
                            FP_MAX_LANES, queue);
    int map_fd = xsk_map_create(n), fd = -1;
    int ports_fd = map_fd < 0 ? -1 : xsk_ports_create(n);
    if (ports_fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
    } else if (test_ports(ports_fd, ports) == 0) {
        fd = xsk_prog_load(map_fd, ports_fd, queue, XDP_DROP, log, sizeof log);
        if (fd < 0)
            PyErr_Format(PyExc_OSError, "the redirect program did not load: %s %s", strerror(errno),
                         log);
    }
    if (map_fd >= 0) /* the program holds the maps */
        close(map_fd);
    if (ports_fd >= 0)
        close(ports_fd);
    return fd < 0 ? NULL : PyLong_FromLong(fd);
}

static PyMethodDef module_methods[] = {
    {"xsk_test_program", py_xsk_test_program, METH_VARARGS, xsk_test_program_doc},
    {"chunk_exponents", py_chunk_exponents, METH_VARARGS, chunk_exponents_doc},
    {"block_scan", py_block_scan, METH_VARARGS, block_scan_doc},
    {"quantise", py_quantise, METH_VARARGS, quantise_doc},
    {"dequantise", py_dequantise, METH_VARARGS, dequantise_doc},
    {"set_simd", py_set_simd, METH_VARARGS, set_simd_doc},
    {"simd", py_simd, METH_NOARGS, "The kernels in use: 'avx2' or 'scalar'."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "hostlib._fastpath",
    "The native per-packet loop of hostlib's stream engine (see hostlib/_fastpath.c).",
    -1,
    module_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

/* The wire constants (fp_wire.h) as module attributes, and WIRE, their names in xdp_agg.proto.wire:
 * hostlib.native_stream checks them and refuses a build made from another layout. */
static int add_wire_constants(PyObject *mod)
{
    PyObject *names = PyTuple_New(0);
#define FP_WIRE_EXPORT(name, value)                                                             \
    if (names &&                                                                                \
        (PyModule_AddIntConstant(mod, #name, value) < 0 ||                                      \
         _PyTuple_Resize(&names, PyTuple_GET_SIZE(names) + 1) < 0 ||                            \
         PyTuple_SetItem(names, PyTuple_GET_SIZE(names) - 1, PyUnicode_FromString(#name)) < 0)) \
        Py_CLEAR(names);
    FP_WIRE_CONSTANTS(FP_WIRE_EXPORT)
#undef FP_WIRE_EXPORT
    return names ? PyModule_AddObject(mod, "WIRE", names) : -1;
}

PyMODINIT_FUNC PyInit__fastpath(void)
{
    fp_set_simd_avx2(fp_cpu_has_avx2());
    if (PyType_Ready(&EngineType) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&module_def);
    if (!mod)
        return NULL;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(mod, "Engine", (PyObject *)&EngineType) < 0 ||
        add_wire_constants(mod) < 0) {
        Py_DECREF(&EngineType);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
