"""A persistent pool of ``torch.distributed`` gloo rank processes.

Starting eight torch processes costs tens of seconds on a small machine, so the test suite
and :mod:`autoshard.testing` share one pool of worker processes that join a single gloo
process group once and then serve jobs for as long as the pool lives. A job runs a
function on every rank of a :class:`~torch.distributed.device_mesh.DeviceMesh` laid over
the first ``prod(mesh_shape)`` ranks of the pool, with the mesh axes named ``"a"``,
``"b"`` and ``"c"``; the results come back as a list indexed by rank.

Example::

    import torch
    import torch.distributed as dist

    from autoshard.runtime.ranks import shared_pool

    def axis_sum(mesh, axis):
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=mesh.get_group(axis))
        return t.item()

    if __name__ == "__main__":
        print(shared_pool().run(axis_sum, (2, 2, 2), "c"))
        # [1.0, 1.0, 5.0, 5.0, 9.0, 9.0, 13.0, 13.0]

Workers are started with the ``spawn`` method, so the function, its arguments and its
result are pickled: define job functions at module level, and guard a script's entry point
with ``if __name__ == "__main__":``. A job that raises on any rank, a worker that dies, and
a job that does not finish within ``timeout_s`` all surface as :class:`RankError`; in the
last two cases the pool is restarted so that the next :meth:`RankPool.run` works. Starting
the workers has its own, longer limit (``start_timeout_s``): importing torch alone can take
tens of seconds on a loaded machine, which says nothing about how long a job may take.
"""

import atexit
import contextlib
import math
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import Any, Self

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["MESH_DIM_NAMES", "RankError", "RankPool", "shared_pool"]

MESH_DIM_NAMES = ("a", "b", "c")
"""Names of the mesh axes, outermost first; a mesh of rank ``k`` uses the first ``k``."""

_READY = 0  # job id of the message a worker sends once it has joined the process group
_POLL_S = 0.5  # how often a waiting process checks that its peer is still alive
_ERROR_GRACE_S = 5.0  # how long to wait for the other ranks once one rank has failed
_CLOSE_GRACE_S = 5.0  # how long close() lets workers exit on their own before killing them
# Workers yield the CPU to their parent, which often prepares the next job while they run
# (ranks outnumber cores, and each one would otherwise get as much CPU as the parent).
_NICENESS = 10

# A rank's answer to a job: (True, pickled result) or (False, remote traceback text). Workers
# send it to the parent as (job id, rank, *answer).
_Answer = tuple[bool, bytes | str]


class RankError(RuntimeError):
    """A job failed on at least one rank, or some ranks did not answer.

    Attributes:
        failures: remote traceback text of each rank whose job raised, in arrival order.
        missing: ranks that gave no answer (dead, hung or abandoned); when this is not
            empty the pool has been restarted.
    """

    def __init__(
        self, message: str, failures: dict[int, str] | None = None, missing: tuple[int, ...] = ()
    ) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})
        self.missing = missing


class RankPool:
    """``world_size`` gloo rank processes that run jobs over device meshes.

    Args:
        world_size: number of worker processes (ranks) in the process group.
        timeout_s: how long the pool waits for each job to finish.
        start_timeout_s: how long it waits for its workers to start and join the process
            group (at start and at each restart). The larger of the two is the gloo
            timeout of the rendezvous and of every collective.
    """

    def __init__(
        self, world_size: int = 8, timeout_s: float = 120.0, start_timeout_s: float = 300.0
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be positive, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._ctx = mp.get_context("spawn")
        self._procs: list[BaseProcess] = []
        self._tasks: list[Queue] = []
        self._results: Queue | None = None
        self._last_job = _READY
        self._start()
        atexit.register(self.close)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called (or the pool failed to restart)."""
        return not self._procs

    def run(
        self, fn: Callable[..., Any], mesh_shape: tuple[int, ...], *args: Any, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(mesh, *args, **kwargs)`` on every rank of a ``mesh_shape`` mesh.

        Every worker builds the mesh (mesh creation is collective over the whole process
        group), but only ranks ``0 .. prod(mesh_shape) - 1`` call ``fn``. Each worker
        reseeds torch with ``torch.manual_seed(0)`` before the job.

        Returns:
            ``fn``'s result on each mesh rank, indexed by rank.

        Raises:
            RankError: ``fn`` raised on some rank (the message carries the remote
                traceback of the first rank to fail), or ranks did not answer within
                ``timeout_s`` or died, in which case the pool is restarted first.
        """
        if self.closed:
            raise RuntimeError("RankPool is closed")
        shape = tuple(int(n) for n in mesh_shape)
        if not 1 <= len(shape) <= len(MESH_DIM_NAMES) or min(shape) < 1:
            raise ValueError(f"mesh_shape must have 1 to 3 positive sizes, got {mesh_shape}")
        if math.prod(shape) > self.world_size:
            raise ValueError(f"mesh {shape} needs more than the pool's {self.world_size} ranks")
        payload = pickle.dumps((fn, args, kwargs))

        self._last_job += 1
        for tasks in self._tasks:
            tasks.put((self._last_job, shape, payload))
        answers, waited = self._collect(self._last_job, self.timeout_s)

        failures = {rank: text for rank, (ok, text) in answers.items() if not ok}
        missing = tuple(rank for rank in range(self.world_size) if rank not in answers)
        if failures or missing:
            message = _describe(failures, missing, waited, self._exit_codes())
            if missing:
                self._kill()
                try:
                    self._start()
                except RankError as restart_error:
                    atexit.unregister(self.close)
                    message += "\nrestarting the pool failed; it is closed"
                    raise RankError(message, failures, missing) from restart_error
                message += "\nthe pool was restarted"
            raise RankError(message, failures, missing)
        return [pickle.loads(answers[rank][1]) for rank in range(math.prod(shape))]

    def close(self) -> None:
        """Stop the workers: ask them to exit, then kill those still running."""
        if self.closed:
            return
        atexit.unregister(self.close)
        for tasks in self._tasks:
            tasks.put(None)
        deadline = time.monotonic() + _CLOSE_GRACE_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _start(self) -> None:
        port = _free_port()
        gloo_timeout = max(self.timeout_s, self.start_timeout_s)
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            self._ctx.Process(
                target=_worker,
                args=(rank, self.world_size, port, gloo_timeout, tasks, self._results),
                kwargs={"parent_pid": os.getpid()},
                name=f"autoshard-rank-{rank}",
                daemon=True,
            )
            for rank, tasks in enumerate(self._tasks)
        ]
        for proc in self._procs:
            proc.start()
        answers, waited = self._collect(_READY, self.start_timeout_s)
        failures = {rank: text for rank, (ok, text) in answers.items() if not ok}
        missing = tuple(rank for rank in range(self.world_size) if rank not in answers)
        if failures or missing:
            message = _describe(failures, missing, waited, self._exit_codes())
            self._kill()
            raise RankError(f"RankPool failed to start: {message}", failures, missing)

    def _kill(self) -> None:
        for proc in self._procs:
            proc.kill()
        for proc in self._procs:
            proc.join()
        for q in [*self._tasks, self._results]:
            q.cancel_join_thread()
            q.close()
        self._procs, self._tasks, self._results = [], [], None

    def _exit_codes(self) -> dict[int, int]:
        return {
            rank: proc.exitcode
            for rank, proc in enumerate(self._procs)
            if proc.exitcode is not None
        }

    def _collect(self, job_id: int, timeout_s: float) -> tuple[dict[int, _Answer], str]:
        """Gather every worker's answer to ``job_id``, in arrival order.

        Stops early when a worker dies, when ``timeout_s`` has passed, or
        ``_ERROR_GRACE_S`` after the first failure (the other ranks may be blocked in a
        collective that the failed rank never joins). Returns the answers and a phrase
        saying how long it waited, for error messages.
        """
        answers: dict[int, _Answer] = {}
        deadline = time.monotonic() + timeout_s
        waited = f"within {timeout_s:g} s"
        while len(answers) < self.world_size:
            now = time.monotonic()
            if now >= deadline or not all(proc.is_alive() for proc in self._procs):
                break
            try:
                answer_job, rank, ok, payload = self._results.get(
                    timeout=min(_POLL_S, deadline - now)
                )
            except queue.Empty:
                continue
            if answer_job != job_id:
                continue  # left over from a job whose wait was interrupted in this process
            answers[rank] = (ok, payload)
            if not ok and deadline > time.monotonic() + _ERROR_GRACE_S:
                deadline = time.monotonic() + _ERROR_GRACE_S
                waited = f"within {_ERROR_GRACE_S:g} s of rank {rank} failing"
        return answers, waited


def _describe(
    failures: dict[int, str], missing: tuple[int, ...], waited: str, exit_codes: dict[int, int]
) -> str:
    """Render a :class:`RankError` message: the first failure in full, then the rest."""
    parts = []
    if failures:
        first, text = next(iter(failures.items()))
        parts.append(f"rank {first} failed:\n{text.rstrip()}")
        if len(failures) > 1:
            parts.append(f"ranks {sorted(failures)} failed in all")
    if missing:
        parts.append(f"ranks {list(missing)} did not answer {waited}")
        parts.extend(f"rank {rank} died with exit code {code}" for rank, code in exit_codes.items())
    return "\n".join(parts)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    tasks: Queue,
    results: Queue,
    *,
    parent_pid: int,
) -> None:
    """Worker process main loop: join the process group, then serve jobs until told to stop.

    A task is ``(job_id, mesh_shape, pickled (fn, args, kwargs))``; ``None`` means stop. The
    worker also stops once its parent is gone, so a killed parent leaves no process behind.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    os.nice(_NICENESS)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=timedelta(seconds=timeout_s),
        )
    except Exception:
        results.put((_READY, rank, False, traceback.format_exc()))
        return
    results.put((_READY, rank, True, b""))

    meshes: dict[tuple[int, ...], DeviceMesh] = {}
    try:
        while True:
            try:
                task = tasks.get(timeout=_POLL_S)
            except queue.Empty:
                if os.getppid() != parent_pid:
                    return
                continue
            if task is None:
                return
            job_id, shape, payload = task
            results.put((job_id, rank, *_run_job(rank, meshes, shape, payload)))
    finally:
        dist.destroy_process_group()


def _run_job(
    rank: int, meshes: dict[tuple[int, ...], DeviceMesh], shape: tuple[int, ...], payload: bytes
) -> _Answer:
    """Run one job on this rank; return ``(True, pickled result)`` or ``(False, traceback)``."""
    try:
        if shape not in meshes:
            # Collective over the whole world: every worker must take part, in job order.
            meshes[shape] = DeviceMesh(
                "cpu",
                torch.arange(math.prod(shape)).reshape(shape),
                mesh_dim_names=MESH_DIM_NAMES[: len(shape)],
            )
        torch.manual_seed(0)
        if rank >= math.prod(shape):
            return True, pickle.dumps(None)
        fn, args, kwargs = pickle.loads(payload)
        return True, pickle.dumps(fn(meshes[shape], *args, **kwargs))
    except Exception:
        return False, traceback.format_exc()


@contextlib.contextmanager
def fake_rank(shape: tuple[int, ...], rank: int = 0) -> Iterator[DeviceMesh]:
    """This process as rank `rank` of a mesh of `shape` whose collectives move nothing
    and take no time (torch's fake process group: results are left unwritten). For
    checking what one rank of a mesh too large to start holds and runs, and for timing
    the CPU a program spends around its collectives, which is what a GPU step pays to
    launch them. The fake group is a private torch module, used here only.

        with fake_rank((8, 8, 8), rank=511) as mesh:
            parallel = autoshard.parallelize(model, mesh, inputs, compiled=compiled)
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=math.prod(shape))
    try:
        yield init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIM_NAMES[: len(shape)])
    finally:
        dist.destroy_process_group()


_shared_pools: dict[int, RankPool] = {}


def shared_pool(world_size: int = 8) -> RankPool:
    """Return this process's pool of ``world_size`` ranks, starting it on first use."""
    pool = _shared_pools.get(world_size)
    if pool is None or pool.closed:
        pool = _shared_pools[world_size] = RankPool(world_size)
    return pool
