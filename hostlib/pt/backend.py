"""The torch.distributed backend "xdpagg": all_reduce through the aggregator, the rest via gloo.

    XDP_AGG_CONTROL=198.18.0.1:48800 torchrun --nnodes 4 ... train.py
    # train.py, unmodified but for the backend's name:
    dist.init_process_group("xdpagg")          # or "cpu:xdpagg"; DDP then all-reduces here

What goes where:
- all_reduce with ReduceOp.SUM or AVG of float32, float16, bfloat16 or int32 tensors: through
  the aggregator (hostlib), sync or async (a Work handle); all_reduce_coalesced and
  _coalescing_manager's all-reduces of such lists as one stream per (wire dtype, width,
  device). int32 sums are exact (wrapping modulo 2^32 like the aggregator), at 32 bits; floats
  are block-scaled (per-element bound in hostlib.scaling: about n^2 2^(E-32) at 32 bits,
  n^2 2^(E-16) at 16, 2^E above the largest magnitude of each packet's chunk). bfloat16 and
  float16 travel as themselves at 16 bits per element, float32 at 32 (XDP_AGG_WIRE_BITS below
  changes that). AVG divides the sum by the world size; PREMUL_SUM(f) (FSDP2's gradient
  divide factor) scales the tensor by f in place, then sums.
- every other all_reduce (MIN, MAX, PRODUCT, ...; int64, float64 and other dtypes the wire
  cannot carry exactly; AVG of integer tensors is refused, as gloo does) and every other
  collective (broadcast, all_gather, all_gather_into_tensor, reduce_scatter, reduce, gather,
  scatter, all_to_all, barrier, send/recv): delegated to a gloo process group that this one
  builds on the same store; a reduce-scatter with PREMUL_SUM(f), which gloo refuses, as a SUM
  of f times (a copy of) the input. A coalesced list goes to gloo as independent tensors
  (gloo's allreduce_coalesced, or one all-reduce each), never as one multi-device call.
Every call is counted per collective, op, dtype and path (path_stats()); an all-reduce that
falls back to gloo warns once (hostlib.pt.FallbackWarning) with the reason.

The groups work with DeviceMesh, FSDP2 (fully_shard), HSDP, DTensor and the functional
collectives (they carry torch's group name and description: see __init__); every group,
sub-groups from new_group(backend="xdpagg") and DeviceMesh included, has its own aggregator
job, left when the group is destroyed. docs/pytorch.md has the user's view.

Settings (environment, read when the group is made, through hostlib.options.HostOptions.from_env):
- XDP_AGG_CONTROL=host:port  the control endpoint (xdp-agg serve); required. Several,
                             comma-separated (host:port,host:port), stripe the job over
                             those aggregators (hostlib.striping).
- XDP_AGG_FALLBACK=gloo      after an aggregator failure, continue over gloo (logged once)
                             instead of raising hostlib.pt.AggregatorLost.
- XDP_AGG_TIMEOUT=seconds    an all-reduce's stall timeout (default 30): how soon a lost
                             aggregator is noticed.
- XDP_AGG_IP=address         this rank's address towards the aggregator (HostOptions.ip),
                             for several ranks on one host with distinct addresses.
- XDP_AGG_ELEMS, XDP_AGG_WINDOW  int32 per packet and slots per worker (HostOptions' elems,
                             window; default "auto", the most the path MTU and the aggregator
                             allow, and hostlib.options.DEFAULT_WINDOW).
- XDP_AGG_LANES=k            run each all-reduce on k lanes (HostOptions.lanes; default 1;
                             the switch topology only).
- XDP_AGG_WIRE_BITS=auto|16|32  the element width of the all-reduces (HostOptions.wire_bits):
                             auto (default) 16 bits for bfloat16 and float16 tensors, 32 for
                             float32 and int32; 32 every one at 32 bits (for exactness over
                             speed); 16 every float one at 16 bits, float32 too (int32 stays
                             at 32). Every rank must set the same.
- XDP_AGG_SECRET_FILE=path   the deployment secret (a copy of `xdp-agg serve`'s, mode 0600);
                             rank 0 needs it to create the job. The other ranks use it too
                             when they have it; a rank without it takes the job's token, which
                             rank 0 puts in the store as soon as the job exists.

The job's name on the control endpoint is the torchrun run id (TORCHELASTIC_RUN_ID) when there
is one, then the group, then a token rank 0 draws and shares through the store, so that two runs
with the same run id, or two groups of one run, never collide.

Every rank must reach the aggregator from its own address: one rank per host (or per network
namespace), as the aggregator tells workers apart by address.
"""

from __future__ import annotations

import functools
import os
import secrets
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeAlias, TypeGuard, TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    PrefixStore,
    ProcessGroupGloo,
    Store,
    Work,
)

from ..options import HostOptions, control_from_env
from .channel import WIRE_DTYPES, AllreduceChannel
from .paths import AGGREGATOR, GLOO, PathStats, op_name

if TYPE_CHECKING:
    from torch._C._distributed_c10d import _DistributedBackendOptions

    from ..communicator import Communicator

BACKEND_NAME = "xdpagg"
# a reduction as c10d passes it: a ReduceOp, or one of its members (ReduceOp.SUM, ...)
_Op: TypeAlias = "dist.ReduceOp | dist.ReduceOp.RedOpType"
# the options of the reductions handed to gloo (all_reduce's, reduce_scatter's)
_Options = TypeVar(
    "_Options", dist.AllreduceOptions, dist.AllreduceCoalescedOptions, dist.ReduceScatterOptions
)


def register_backend() -> None:
    """Register "xdpagg" with torch.distributed (idempotent; installing the package makes torch
    call it on import through its `torch.backends` entry point)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])


def _create(opts: _DistributedBackendOptions, _backend_options: object) -> ProcessGroupXdpAgg:
    """Creator called by init_process_group / new_group (the extended API: it gives the group's
    name, used in the job name)."""
    return ProcessGroupXdpAgg(
        opts.store, opts.group_rank, opts.group_size, opts.timeout, group_name=str(opts.group_id)
    )


class _FutureWork(Work):
    """A Work handle over a torch Future: wait() re-raises the future's error (the c10d helper
    _create_work_from_future swallows it, which would hide a lost aggregator).

    sources: the futures to wait for first, whose errors wait() raises as they are (a Future
    made with then() would wrap them in a RuntimeError).
    """

    def __init__(
        self, fut: torch.futures.Future[Any], sources: Iterable[torch.futures.Future[Any]] = ()
    ) -> None:
        super().__init__()
        self._fut = fut
        self._sources = list(sources)

    def wait(self, timeout: timedelta | None = None) -> bool:
        # raises the all-reduce's error; hostlib's stall timeout bounds how long this takes
        for s in self._sources:
            s.wait()
        self._fut.wait()
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:  # noqa: BLE001 - any error means no success
            return False
        return True

    def result(self) -> list[torch.Tensor]:
        return self._fut.value()


class _AllWork(Work):
    """The Work of several gloo Works (a coalesced collective done one tensor at a time):
    wait() waits for each. gloo's _reduce_scatter_base gives a Work without a future
    (Work::getFuture raises "not implemented"), so none is built from theirs; _coalescing_manager
    only calls wait()."""

    def __init__(self, works: list[Work], value: list[torch.Tensor]) -> None:
        super().__init__()
        self._works = works
        self._value = value

    def wait(self, timeout: timedelta | None = None) -> bool:
        for w in self._works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def result(self) -> list[torch.Tensor]:
        return self._value


class ProcessGroupXdpAgg(dist.ProcessGroup):
    """A process group whose all_reduce runs through the xdp-agg aggregator (see the module
    docstring for what is delegated to gloo). Made by init_process_group("xdpagg")."""

    def __init__(
        self, store: Store, rank: int, size: int, timeout: timedelta, *, group_name: str = "0"
    ) -> None:
        # torch's stub declares ProcessGroup(store, rank, size) only; the binding also has
        # ProcessGroup(rank, size), the constructor of a Python subclass (torch 2.13)
        super().__init__(rank, size)  # type: ignore[call-arg]
        import hostlib

        control = control_from_env()
        if not control:
            raise ValueError(
                "the xdpagg backend needs XDP_AGG_CONTROL=host:port, the control endpoint of the "
                "aggregator (xdp-agg serve)"
            )
        # the environment's options (hostlib.options), with the group's rendezvous timeout
        opts = HostOptions.from_env(rendezvous_timeout=max(timeout.total_seconds(), 10.0))
        gloo = ProcessGroupGloo(PrefixStore("xdpagg/gloo/", store), rank, size, timeout)
        # torch's stub of Backend, ProcessGroupGloo's base, declares none of the collectives
        # the binding has (torch 2.13): the calls to the delegate are checked at run time only
        self._gloo: Any = gloo
        # torch keeps a group's name and description on its registered backends, not on the
        # ProcessGroup: ProcessGroup::getGroupName raises "ProcessGroup name not set" while there
        # is none. For a ProcessGroup subclass, distributed_c10d._new_process_group_helper
        # (torch 2.13) registers no backend ("pg = backend_class; break") and then calls
        # pg._set_group_name / _set_group_desc, which reach only registered backends. So the
        # delegate is registered as this group's CPU backend: the name and description land
        # on it, and DeviceMesh (device_mesh._init_one_process_group reads .group_name),
        # FSDP2 and _functional_collectives (they resolve groups by that name through the
        # registry c10d._register_process_group fills) find this group. Collectives still
        # come here: dist.* and the functional collectives' dispatcher ops call this
        # subclass's overrides (PyProcessGroup), not the registered backend.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, gloo)
        stall = opts.timeout
        fallback = None
        if opts.fallback == "gloo":
            # its own gloo group: the agreement after a failure runs on the channel's thread and
            # must not interleave with the delegated collectives of the training loop
            fallback = ProcessGroupGloo(
                PrefixStore("xdpagg/fallback/", store), rank, size, timedelta(seconds=stall + 30)
            )
        self.job = _job_name(store, rank, group_name)
        self.premul_sums = 0  # PREMUL_SUM collectives turned into scale + SUM (a diagnostic)
        self.paths = PathStats(f"xdpagg (job {self.job})")
        token_key = f"xdpagg/token/{self.job}"
        token = None
        if rank > 0 and not opts.secret_file:
            token = store.get(token_key).decode()  # waits for rank 0's create

        def share_token(t: str) -> None:  # rank 0: for the ranks without the secret
            store.set(token_key, t)

        comm = hostlib.init(
            rank,
            size,
            control,
            self.job,
            opts,
            token=token,
            on_token=share_token if rank == 0 else None,
        )
        self.channel = AllreduceChannel(
            comm,
            fallback=fallback,
            own_comm=True,
            name=f"xdpagg (job {self.job})",
            wire_bits=opts.wire_bits,
        )

    # --- identity ---------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - the c10d name
        """ "xdpagg", the backend's name (BACKEND_NAME)."""
        return BACKEND_NAME

    def name(self) -> str:
        """ "xdpagg", the backend's name (BACKEND_NAME)."""
        return BACKEND_NAME

    @property
    def comm(self) -> Communicator:
        """The hostlib Communicator (stats, status)."""
        return self.channel.comm

    # --- all-reduce -------------------------------------------------------------------------
    # c10d calls both with a list and options; the overloads of torch's stub that take one
    # tensor or an op and a timeout are ProcessGroup's own conveniences, not what it calls
    def allreduce(  # type: ignore[override]
        self, tensors: Sequence[torch.Tensor], opts: dist.AllreduceOptions | None = None
    ) -> Work:
        """all_reduce: SUM/AVG of wire dtypes through the aggregator, the rest through gloo."""
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._reduce("all_reduce", list(tensors), opts.reduceOp, coalesced=False)

    def allreduce_coalesced(
        self, tensors: Sequence[torch.Tensor], opts: dist.AllreduceCoalescedOptions | None = None
    ) -> Work:
        """all_reduce_coalesced (and _coalescing_manager's all_reduce): each tensor summed on its
        own, the list through the aggregator as one stream per wire dtype, or through gloo."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._reduce("all_reduce_coalesced", list(tensors), op, coalesced=True)

    def path_stats(self) -> list[dict[str, object]]:
        """Calls per collective, op, dtype and path ("aggregator" or "gloo"): see paths.py."""
        return self.paths.rows()

    def _reduce(
        self, collective: str, tensors: list[torch.Tensor], op: _Op, coalesced: bool
    ) -> Work:
        """The one entry of every all-reduce: picks the path, counts it, runs it."""
        asked = op
        if _is_premul(op):
            self.premul_sums += 1
            # PREMUL_SUM(f) (FSDP2's gradient divide factor; gloo refuses it) is sum(f x_i):
            # scale in place (all_reduce's result replaces its input anyway), then SUM
            for t in tensors:
                t.mul_(_premul_factor(op, t))
            op = dist.ReduceOp.SUM
        reason = _why_not_on_wire(tensors, op, coalesced)
        if reason is None:
            bits = {self.channel.wire_bits_of(t.dtype) for t in tensors}
            self.paths.record(collective, asked, tensors, AGGREGATOR, wire_bits=bits)
            return self._aggregate(tensors, op == dist.ReduceOp.AVG)
        self.paths.record(collective, asked, tensors, GLOO, reason)
        return self._gloo_reduce(tensors, op, coalesced)

    def _aggregate(self, tensors: list[torch.Tensor], avg: bool) -> Work:
        """Sum the tensors through the aggregator: one tensor as it is; a coalesced list as one
        flat stream per (wire dtype, width, device), scattered back when it completes. The
        channel runs its all-reduces in submission order, the same on every rank."""
        if not tensors:
            return _FutureWork(_done(tensors))
        if len(tensors) == 1:
            fut = self.channel.submit(tensors[0], average=avg, value=tensors)
            return _FutureWork(fut)
        raw, done = [], []
        for (dtype, bits, _), group in _wire_groups(tensors, self.channel).items():
            flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in group])
            fut = self.channel.submit(flat, average=avg, wire_bits=bits)
            raw.append(fut)
            done.append(fut.then(functools.partial(_scatter_back_done, group)))
        everything = torch.futures.collect_all(done).then(lambda _: tensors)
        return _FutureWork(everything, raw)

    def _gloo_reduce(self, tensors: list[torch.Tensor], op: _Op, coalesced: bool) -> Work:
        """The all-reduce on gloo, with gloo's meaning of the list: all_reduce's list is one
        tensor per device (gloo reduces its entries into each other), all_reduce_coalesced's
        is independent tensors (gloo's coalesced call when they share a dtype, else one call
        each). gloo has no AVG: SUM, then divide (floating types only, as AVG is defined)."""
        avg = op == dist.ReduceOp.AVG
        if avg and any(not (t.is_floating_point() or t.is_complex()) for t in tensors):
            raise ValueError("ReduceOp.AVG is only defined for floating-point tensors here")
        red = dist.ReduceOp.SUM if avg else op
        if not coalesced:
            works = [self._gloo.allreduce(tensors, _opts(dist.AllreduceOptions, red))]
        elif _one_gloo_call(tensors):
            o = _opts(dist.AllreduceCoalescedOptions, red)
            works = [self._gloo.allreduce_coalesced(tensors, o)]
        else:
            works = [self._gloo.allreduce([t], _opts(dist.AllreduceOptions, red)) for t in tensors]
        n = self.size()

        def finish(_: object) -> list[torch.Tensor]:
            for t in tensors if avg else ():
                t.div_(n)
            return tensors

        futs = [w.get_future() for w in works]
        return _FutureWork(torch.futures.collect_all(futs).then(finish), futs)

    # --- everything else: gloo --------------------------------------------------------------
    def _count(self, collective: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Count a call of a collective that gloo carries (path_stats()): the tensors of its
        positional arguments, and the op of its options argument, if it has one."""
        opts = [a for a in (*args, *kwargs.values()) if hasattr(a, "reduceOp")]
        op = opts[0].reduceOp if opts else None
        self.paths.record(collective, op, args, GLOO)

    def _delegate(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Work:
        """Count a call of gloo's collective `name` and make it on the gloo delegate, with the
        caller's arguments as they are (every form torch's ProcessGroup has for it)."""
        self._count(name, args, kwargs)
        return getattr(self._gloo, name)(*args, **kwargs)

    def broadcast(self, *args: Any, **kwargs: Any) -> Work:
        """broadcast: delegated to the gloo group built on the same store."""
        return self._delegate("broadcast", args, kwargs)

    def allgather(self, *args: Any, **kwargs: Any) -> Work:
        """allgather: delegated to the gloo group built on the same store."""
        return self._delegate("allgather", args, kwargs)

    def _allgather_base(self, *args: Any, **kwargs: Any) -> Work:
        """_allgather_base: delegated to the gloo group built on the same store."""
        return self._delegate("_allgather_base", args, kwargs)

    def allgather_coalesced(self, *args: Any, **kwargs: Any) -> Work:
        """allgather_coalesced: delegated to the gloo group built on the same store."""
        return self._delegate("allgather_coalesced", args, kwargs)

    def reduce(self, *args: Any, **kwargs: Any) -> Work:
        """reduce: delegated to the gloo group built on the same store."""
        return self._delegate("reduce", args, kwargs)

    def gather(self, *args: Any, **kwargs: Any) -> Work:
        """gather: delegated to the gloo group built on the same store."""
        return self._delegate("gather", args, kwargs)

    def scatter(self, *args: Any, **kwargs: Any) -> Work:
        """scatter: delegated to the gloo group built on the same store."""
        return self._delegate("scatter", args, kwargs)

    def alltoall(self, *args: Any, **kwargs: Any) -> Work:
        """alltoall: delegated to the gloo group built on the same store."""
        return self._delegate("alltoall", args, kwargs)

    def alltoall_base(self, *args: Any, **kwargs: Any) -> Work:
        """alltoall_base: delegated to the gloo group built on the same store."""
        return self._delegate("alltoall_base", args, kwargs)

    def barrier(self, *args: Any, **kwargs: Any) -> Work:
        """barrier: delegated to the gloo group built on the same store."""
        return self._delegate("barrier", args, kwargs)

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> Work:
        """monitored_barrier: delegated to the gloo group built on the same store."""
        return self._delegate("monitored_barrier", args, kwargs)

    def send(self, *args: Any, **kwargs: Any) -> Work:
        """send: delegated to the gloo group built on the same store."""
        return self._delegate("send", args, kwargs)

    def recv(self, *args: Any, **kwargs: Any) -> Work:
        """recv: delegated to the gloo group built on the same store."""
        return self._delegate("recv", args, kwargs)

    def recv_anysource(self, *args: Any, **kwargs: Any) -> Work:
        """recv_anysource: delegated to the gloo group built on the same store."""
        return self._delegate("recv_anysource", args, kwargs)

    # torch 2.13's names of the tensor-to-tensor collectives, on gloo's older names
    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions | None = None
    ) -> Work:
        """all_gather_into_tensor: gloo's _allgather_base."""
        self._count("all_gather_into_tensor", (output, input, opts), {})
        return self._gloo._allgather_base(output, input, opts or AllgatherOptions())

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        opts: dist.ReduceScatterOptions | None = None,
    ) -> Work:
        """reduce_scatter_tensor: gloo's _reduce_scatter_base (PREMUL_SUM as scale + SUM)."""
        self._count("reduce_scatter_tensor", (output, input, opts), {})
        return self._gloo_reduce_scatter(output, input, opts)

    # reduce_scatter_tensor by torch's older name. torch's stub names that entry's parameters
    # outputTensor and inputTensor; c10d calls it with positional arguments only
    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def _gloo_reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        opts: dist.ReduceScatterOptions | None = None,
    ) -> Work:
        """reduce_scatter_tensor on gloo; PREMUL_SUM(f) becomes SUM of f * input (a copy: the
        caller's input stays as it was)."""
        if opts is not None and _is_premul(opts.reduceOp):
            self.premul_sums += 1
        input, o = _premul_to_sum(input, opts, dist.ReduceScatterOptions)
        return self._gloo._reduce_scatter_base(output, input, o)

    def reduce_scatter(  # type: ignore[override]  # c10d's form: lists and options
        self,
        outputs: list[torch.Tensor],
        inputs: list[list[torch.Tensor]],
        opts: dist.ReduceScatterOptions | None = None,
    ) -> Work:
        """reduce_scatter of tensor lists on gloo; PREMUL_SUM as in _reduce_scatter_base."""
        self._count("reduce_scatter", (outputs, inputs, opts), {})
        o = opts
        if opts is not None and _is_premul(opts.reduceOp):
            self.premul_sums += 1
            inputs = [
                [_premul_to_sum(t, opts, dist.ReduceScatterOptions)[0] for t in ts] for ts in inputs
            ]
            o = _opts(dist.ReduceScatterOptions, dist.ReduceOp.SUM)
        return self._gloo.reduce_scatter(outputs, inputs, o or dist.ReduceScatterOptions())

    def all_to_all_single(  # type: ignore[override]  # c10d's form: with options
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        opts: dist.AllToAllOptions | None = None,
    ) -> Work:
        """all_to_all_single: gloo's alltoall_base."""
        self._count("all_to_all_single", (output, input, output_splits, input_splits, opts), {})
        return self._gloo.alltoall_base(
            output, input, output_splits, input_splits, opts or dist.AllToAllOptions()
        )

    def allgather_into_tensor_coalesced(
        self,
        output_lists: list[torch.Tensor],
        input_list: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> Work:
        """all_gather_into_tensor of several tensors (one gloo _allgather_base each)."""
        outputs, inputs = output_lists, input_list  # torch's names: a tensor each, not lists
        self._count("all_gather_into_tensor_coalesced", (outputs, inputs, opts), {})
        works = [
            self._gloo._allgather_base(o, i, AllgatherOptions()) for o, i in zip(outputs, inputs)
        ]
        return _AllWork(works, list(outputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter_tensor_coalesced(
        self,
        outputTensors: list[torch.Tensor],  # noqa: N803 - torch's names
        inputTensors: list[torch.Tensor],  # noqa: N803
        opts: dist.ReduceScatterOptions | None = None,
    ) -> Work:
        """reduce_scatter_tensor of several tensors (one gloo _reduce_scatter_base each)."""
        outputs, inputs = outputTensors, inputTensors
        self._count("reduce_scatter_tensor_coalesced", (outputs, inputs, opts), {})
        works = [self._gloo_reduce_scatter(o, i, opts) for o, i in zip(outputs, inputs)]
        return _AllWork(works, list(outputs))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def shutdown(self) -> None:
        """Finish pending all-reduces, leave the aggregator job, shut gloo down."""
        self.channel.close()
        try:
            self._gloo.shutdown()
        except RuntimeError:
            pass  # an older or already shut down gloo group


def _is_premul(op: _Op) -> TypeGuard[dist.ReduceOp]:
    # ReduceOp's `op` (its RedOpType) is bound in torch but missing from its stub (torch 2.13)
    return isinstance(op, dist.ReduceOp) and op.op == dist.ReduceOp.PREMUL_SUM  # type: ignore[attr-defined]


def _premul_factor(op: dist.ReduceOp, t: torch.Tensor) -> float | torch.Tensor:
    """PREMUL_SUM's factor (a Python number, or a tensor, as ReduceOp.PREMUL_SUM allows)."""
    f = op.factor
    return f.to(t.device) if isinstance(f, torch.Tensor) else f


def _premul_to_sum(
    t: torch.Tensor, opts: _Options | None, options_type: type[_Options]
) -> tuple[torch.Tensor, _Options]:
    """(input, options) for gloo: PREMUL_SUM(f) as (f * t, SUM); anything else unchanged."""
    if opts is None or not _is_premul(opts.reduceOp):
        return t, opts if opts is not None else options_type()
    return t * _premul_factor(opts.reduceOp, t), _opts(options_type, dist.ReduceOp.SUM)


def _why_not_on_wire(tensors: list[torch.Tensor], op: _Op, coalesced: bool) -> str | None:
    """None when the aggregator carries this all-reduce; else why it goes to gloo."""
    if op != dist.ReduceOp.SUM and op != dist.ReduceOp.AVG:
        return f"ReduceOp.{op_name(op)} (the aggregator sums: SUM, AVG and PREMUL_SUM only)"
    if len(tensors) > 1 and not coalesced:
        return "a list of several tensors (one per device, reduced into each other, as in gloo)"
    for t in tensors:
        if t.dtype not in WIRE_DTYPES or t.is_complex():
            return f"{t.dtype} (the wire carries float32, float16, bfloat16 and int32)"
        if t.is_sparse or t.layout != torch.strided:
            return f"a {t.layout} tensor (the wire carries dense tensors)"
        if t.device.type not in ("cpu", "cuda"):
            return f"a tensor on {t.device.type} (the channel stages cpu and cuda tensors)"
        if op == dist.ReduceOp.AVG and t.dtype == torch.int32:
            return "AVG of int32 (gloo refuses AVG of integers with its message)"
    return None


def _wire_dtype(dtype: torch.dtype, wire_bits: int) -> torch.dtype:
    """The dtype a tensor travels as in a coalesced stream at `wire_bits` per element: int32;
    at 16 bits a float as itself (bfloat16 and float16 go to hostlib as they are, float32 too);
    at 32 bits float32 for every float (one stream for them all: float32 holds bfloat16 and
    float16 exactly, and a 32-bit sum rounded once to the tensor's dtype is what a tensor of
    its own would get, to within the bound)."""
    if dtype == torch.int32 or wire_bits == 16:  # int32 only ever at 32 bits
        return dtype
    return torch.float32


_StreamKey: TypeAlias = tuple[torch.dtype, int, torch.device]


def _wire_groups(
    tensors: list[torch.Tensor], channel: AllreduceChannel
) -> dict[_StreamKey, list[torch.Tensor]]:
    """The tensors grouped by stream, (wire dtype, width, device) with the width of the
    channel's policy, in order of first appearance (the same on every rank, as the ranks pass
    the same list)."""
    groups: dict[_StreamKey, list[torch.Tensor]] = {}
    for t in tensors:
        bits = channel.wire_bits_of(t.dtype)
        groups.setdefault((_wire_dtype(t.dtype, bits), bits, t.device), []).append(t)
    return groups


def _scatter_back_done(group: list[torch.Tensor], fut: torch.futures.Future[torch.Tensor]) -> None:
    """_scatter_back of the summed stream `fut` completed with."""
    _scatter_back(fut.value(), group)


def _scatter_back(flat: torch.Tensor, group: list[torch.Tensor]) -> None:
    """Copy each tensor's slice of the summed stream back into it (converting the dtype)."""
    at = 0
    for t in group:
        n = t.numel()
        t.detach().copy_(flat[at : at + n].view(t.shape))
        at += n


def _one_gloo_call(tensors: list[torch.Tensor]) -> bool:
    """Whether gloo's allreduce_coalesced takes the list (dense CPU tensors of one dtype)."""
    return len({t.dtype for t in tensors}) == 1 and all(
        t.device.type == "cpu" and t.layout == torch.strided for t in tensors
    )


def _opts(options_type: type[_Options], op: _Op) -> _Options:
    """New options of `options_type` with the reduction `op`."""
    o = options_type()
    # a RedOpType (ReduceOp.SUM) as the ReduceOp the field holds (the binding converts it too)
    o.reduceOp = op if isinstance(op, dist.ReduceOp) else dist.ReduceOp(op)
    return o


def _done(value: list[torch.Tensor]) -> torch.futures.Future[list[torch.Tensor]]:
    fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    fut.set_result(value)
    return fut


def _job_name(store: Store, rank: int, group_name: str) -> str:
    """The job's name: run id, group and a token of rank 0's, agreed through the store."""
    key = "xdpagg/job"
    if rank == 0:
        run = os.environ.get("TORCHELASTIC_RUN_ID") or "torch"
        # at most 196 characters: hostlib names a 16-bit companion job name + "~w16", and the
        # control endpoint takes names of up to 200
        name = f"{run}.g{group_name}.{secrets.token_hex(4)}"[-196:]
        store.set(key, name)
        return name
    return store.get(key).decode()
