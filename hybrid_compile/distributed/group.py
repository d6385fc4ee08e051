"""The tensor-parallel process group: ranks, devices, collectives and the error channel.

One process per device. The default torch.distributed group (NCCL on CUDA, gloo on CPU) carries
the model's collectives and the steps' packed metadata; a second gloo group with a long timeout
carries the small step headers that follower ranks block on while the leader (rank 0) is idle.
The model's collectives are the functional collective ops themselves
(``torch.ops._c10d_functional.all_reduce`` / ``all_gather_into_tensor``, each followed by its
``wait_tensor``) on the group's name, so Dynamo traces them into the graph like any other op. Not
the Python wrappers of ``torch.distributed._functional_collectives``: their helpers differ between
torch releases, and torch 2.11's ``all_gather_tensor`` on a non-zero dim calls
``torch._utils._maybe_view_chunk_cat``, which Dynamo refuses to trace (a graph break). Where the
one-shot all-reduce runs (``one_shot.py``: small all-reduces as one kernel over symmetric memory),
the all-reduces are its custom op instead.

Errors: a rank that fails records ``rank R: <error>`` in the rendezvous store under one key
(the first failure wins), then tears its process group down, which breaks every collective the
other ranks wait in; they read the recorded error and raise :class:`TensorParallelError` with it.
"""

from __future__ import annotations

import datetime
import itertools
import os
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import one_shot

_ERROR_KEY = "hybrid_compile/tp/error"
_ERROR_COUNT = "hybrid_compile/tp/errors"
# how long a rank whose collective broke waits for the failing rank's recorded error
_ERROR_WAIT_SECONDS = 10.0
# the step-header group: followers wait in it for as long as the leader is idle
_IDLE_TIMEOUT = datetime.timedelta(days=7)
DEFAULT_TIMEOUT_SECONDS = 300.0
# the engines this process joined through torchrun's environment: each rendezvous under its own
# key prefix (every rank creates its engines in the same order, so the numbers agree)
_ENV_ENGINES = itertools.count()


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel engine failed; the message names the rank and its error."""


@dataclass
class TensorParallelGroup:
    """This process's place in a tensor-parallel group (see the module docstring)."""

    rank: int
    size: int
    device: torch.device
    group: "dist.ProcessGroup"  # model collectives + step payloads (NCCL on CUDA, gloo on CPU)
    control: "dist.ProcessGroup"  # step headers (gloo, long timeout)
    store: "dist.Store"
    owns_default_group: bool = True  # destroy the default group at shutdown (False: the user made it)
    # the model's all-reduces through the one-shot op (one_shot.py; its buffer mapped by enable_one_shot)
    one_shot: bool = False
    # why "auto" kept the all-reduces on NCCL though the devices could run the one-shot op (None: it did not)
    one_shot_unpaired: str | None = None
    closed: bool = field(default=False)
    # the name the functional collective ops take for ``group``; read once here, outside traced code
    group_name: str = field(init=False)

    def __post_init__(self) -> None:
        self.group_name = self.group.group_name

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # -- model collectives (traced by Dynamo) ---------------------------------------------------
    # Each collective is waited right away: eagerly that is the synchronisation; in a graph the
    # wait is the node the split pass keeps in the collective's piece (compilation/split.py).
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.one_shot:
            return torch.ops.hybrid_compile.tp_all_reduce(x, self.group_name)
        return one_shot.functional_all_reduce(x, self.group_name)

    def enable_one_shot(self) -> None:
        """Route the model's all-reduces through the one-shot op over symmetric memory (a collective:
        every rank calls it at the same point; ``one_shot.resolve`` decided that it runs here)."""
        one_shot.enable(self.group_name, self.device)
        self.one_shot = True

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., n]`` on every rank -> ``[..., size * n]``, rank r's columns at ``r * n``."""
        ops = torch.ops._c10d_functional
        # the op gathers along dim 0: [size * d0, ..., n], rank r's block r; move the rank axis
        # next to the last one and merge the two
        gathered = ops.wait_tensor(ops.all_gather_into_tensor(x.contiguous(), self.size, self.group_name))
        by_rank = gathered.view(self.size, *x.shape).movedim(0, -2)
        return by_rank.reshape(*x.shape[:-1], self.size * x.shape[-1])

    # -- host-side helpers -----------------------------------------------------------------------
    def all_min(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return t.tolist()

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (same length everywhere), by rank."""
        t = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t, group=self.control)
        return [o.tolist() for o in out]

    # -- failures -------------------------------------------------------------------------------
    def recorded_error(self, wait: float = 0.0) -> str | None:
        """The first failure any rank recorded, waiting up to ``wait`` seconds for one."""
        try:
            if wait > 0:
                self.store.wait([_ERROR_KEY], datetime.timedelta(seconds=wait))
            elif not self.store.check([_ERROR_KEY]):
                return None
            return self.store.get(_ERROR_KEY).decode(errors="replace")
        except Exception:  # no key before the deadline, or the store is gone with its host
            return None

    def fail(self, error: BaseException) -> TensorParallelError | None:
        """Record this rank's failure (unless another rank's came first) and tear the group down.
        Returns None when ``error`` is the group's first failure (raise it as it is), else a
        :class:`TensorParallelError` carrying the first failure (this rank only saw a collective
        break because of it)."""
        first_here = False
        try:
            if self.store.add(_ERROR_COUNT, 1) == 1:
                tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))[-4000:]
                self.store.set(_ERROR_KEY, f"rank {self.rank}: {type(error).__name__}: {error}\n{tb}")
                first_here = True
        except Exception:  # the store's host (rank 0) is gone
            pass
        recorded = None if first_here else self.recorded_error(wait=_ERROR_WAIT_SECONDS)
        self.shutdown()
        if first_here or isinstance(error, TensorParallelError):
            return None
        first = recorded.split("\n", 1)[0] if recorded else f"rank {self.rank}: {type(error).__name__}: {error}"
        return TensorParallelError(f"tensor-parallel engine failed: {first}")

    def shutdown(self, together: bool = False) -> None:
        """Destroy the groups. ``together`` (a normal close, every rank closing): meet in a barrier
        first, so no rank tears its connections down while another still uses them (gloo then
        aborted the slower rank at exit: "terminate called without an active exception")."""
        if self.closed:
            return
        self.closed = True
        if self.one_shot:
            one_shot.disable(self.group_name)
        if together:
            try:
                dist.barrier(group=self.control)
            except Exception:  # another rank failed meanwhile: its error travels through the store
                pass
        try:
            dist.destroy_process_group(self.control)
        except Exception:
            pass
        if self.owns_default_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when this process was started by torchrun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return rank, world, int(os.environ.get("LOCAL_RANK", rank))
    return None


def is_torchrun_follower(tensor_parallel_size: int) -> bool:
    """Whether this process is a rank other than 0 of a tensor-parallel engine started by torchrun:
    its ``from_pretrained(..., tensor_parallel_size=N)`` follows rank 0's steps and returns None."""
    env = torchrun_env()
    return tensor_parallel_size > 1 and env is not None and env[0] != 0


def rank_device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise TensorParallelError(
                f"tensor parallelism: local rank {local_rank} has no CUDA device (this host has "
                f"{torch.cuda.device_count()}); use at most one rank per GPU"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_group(
    rank: int, size: int, device: torch.device, timeout: float, *, store: "dist.Store | None" = None
) -> TensorParallelGroup:
    """Join (or reuse) the default process group and build this rank's :class:`TensorParallelGroup`.
    ``store``: the rendezvous store (spawned ranks); None = torchrun's environment (``env://``:
    its store, under a prefix of this engine's own)."""
    owns = not dist.is_initialized()
    if owns:
        kwargs = dict(backend=backend_for(device.type), timeout=datetime.timedelta(seconds=timeout))
        if device.type == "cuda":
            kwargs["device_id"] = device
        if store is None:
            # torchrun's store outlives an engine: a second engine of this process rendezvousing
            # under the first one's keys would find them set and go ahead without the other ranks
            base, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=size,
                                              timeout=datetime.timedelta(seconds=timeout)))
            store = dist.PrefixStore(f"hybrid_compile/engine{next(_ENV_ENGINES)}/", base)
        dist.init_process_group(store=store, rank=rank, world_size=size, **kwargs)
    if dist.get_world_size() != size or dist.get_rank() != rank:
        raise TensorParallelError(
            f"tensor_parallel_size={size} but the torch.distributed group of this process has "
            f"{dist.get_world_size()} ranks (this is rank {dist.get_rank()}); start one process per rank "
            f"(torchrun --nproc-per-node {size})"
        )
    if store is None:
        store = dist.distributed_c10d._get_default_store()
    control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    return TensorParallelGroup(rank, size, device, dist.group.WORLD, control, store, owns_default_group=owns)


_current: TensorParallelGroup | None = None


def current_group() -> TensorParallelGroup | None:
    """The tensor-parallel group this process serves in (None: no tensor parallelism)."""
    return _current


def set_current_group(group: TensorParallelGroup | None) -> None:
    global _current
    _current = group
