"""``ExecutionContext``: a ticket to run a graph on a kind of device.

Creating one does no backend work: it records the graph and the resolved target kind and
holds a reference that keeps the graph's compiled sessions alive until ``close``. The
device actor is chosen per request (least loaded of the kind, or the one holding a native
input), and compiles the graph there on first use.

Two ways to run, both from trio:

* ``await ctx.compute({"input": array})`` returns every output as a :class:`Tensor`.
  On a GPU (or with ``keep_on_device=True``) outputs are backend-native values left on
  the device: pass one straight into another compute on the same device and it is not
  copied through host memory; ``.numpy()`` reads it (counted by ``wasinn.host_copies``).
  On the CPU they are host arrays by default (each counted by ``wasinn.host_copies`` too:
  it left the backend's native form), which feed the next compute without a copy;
* staged (wasi-nn): ``set_input`` / ``set_output`` (bind a host buffer that ``run`` fills
  in place) / ``await run()`` / ``get_output``. Inputs stay set across runs.

A caller that runs in a thread of its own (a guest's ``trio.to_thread`` worker) can have
the backend run in that thread instead of a device worker thread. ``ctx.try_lease(...)``
(from that thread, no trio) takes a free device slot when the graph is already compiled
there and nobody is queued; otherwise ``await ctx.lease(...)`` (in trio, e.g. through
``trio.from_thread.run``). Either returns a :class:`ContextRun`, whose ``run()`` is called
in the caller's thread. The one from ``try_lease`` holds a slot: it runs the model there
and gives the slot back without waiting for trio. ``lease`` does the same when the device
is free; on a busy device it queues the request as ``compute`` does and returns once it
has run (a settled ContextRun): the worker thread that frees a slot starts the next
queued request's run at once (see :mod:`wasinn.actors.slots`), whereas a caller's thread
granted the slot by trio would leave the device idle for two thread wake-ups and a trio
round trip between runs. ``compute_in_caller_thread`` / ``run_in_caller_thread`` do it
all: no trio round trip per request on an idle device, and one on a busy one. A request
run in the caller's thread cannot be abandoned (that thread is the one running it): when
its timeout passes, or another thread calls ``ContextRun.interrupt``, the run is stopped
where the backend can stop it (ONNX Runtime, OpenVINO, a ``torch.export`` program, a
TorchScript loop: see :mod:`wasinn.backends.pytorch`).

Keys are input/output names, their positions or their aliases; a request's input keys
are resolved to the input names before it reaches a device (:func:`tensor_inputs`), so
that every backend is handed names, as ``CompiledGraph.run`` takes them, and a position
the graph does not have is an UnknownNameError here. Contexts are not thread-safe: use them
from the trio thread (guests' worker threads go through ``trio.from_thread``), or from the
one thread that owns them through the caller-thread methods.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import sys
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from wasinn._utf8 import utf8_text
from wasinn.actors.slots import QUEUE_OWNER, QueueOwner
from wasinn.backends.base import TensorSpec
from wasinn.enums import ExecutionTarget
from wasinn.errors import (
    ClosedResourceError,
    InvalidArgumentError,
    TimeoutError_,
    UnknownNameError,
    WasiNNError,
)
from wasinn.tensor import Tensor, as_tensor

from .binding import OutputBuffer, fill
from .model import Executable, GivenInputs, Inputs
from .triorun import A_REQUEST, check_trio_run, yields_when_refused

if TYPE_CHECKING:
    from wasinn.actors.lease import Lease


def spec_name(specs: tuple[TensorSpec, ...], key: str | int, role: str, owner: str,
              aliases: Mapping[str, int] | None = None) -> str:
    """The name of the input/output ``key`` (a name, one of its ``aliases``, or a
    position) names: the keys a run accepts.

    Raises UnknownNameError (an InvalidArgumentError) naming what the graph has.
    """
    if isinstance(key, str):
        for spec in specs:
            if spec.name == key:
                return spec.name
        alias = aliases.get(key) if aliases else None
        if alias is not None and 0 <= alias < len(specs):
            return specs[alias].name
    elif not isinstance(key, bool | np.bool_) and hasattr(type(key), "__index__"):
        index = operator.index(key)  # an int, or numpy's
        if 0 <= index < len(specs):
            return specs[index].name
    have = ", ".join(f"{i}={s.describe()}" for i, s in enumerate(specs)) or "none"
    raise UnknownNameError(f"{owner} has no {role} {key!r}: expected one of {have}")


def check_timeout(timeout: object) -> float | None:
    """``timeout`` as seconds (None: no timeout; inf for an integer too large for a
    float); InvalidArgumentError unless it is None or a real number >= 0 (not a bool,
    not NaN)."""
    if timeout is None:
        return None
    if type(timeout) is int:
        if abs(timeout) > sys.float_info.max:  # past any float: as good as no timeout
            timeout = math.inf if timeout > 0 else -math.inf
    elif type(timeout) is not float:
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
            raise InvalidArgumentError(
                f"timeout {timeout!r} ({type(timeout).__name__}): expected a number of "
                "seconds >= 0, or None for no timeout")
        timeout = float(timeout)
    if not timeout >= 0:  # negative, or NaN
        raise InvalidArgumentError(
            f"timeout {timeout}: expected a number of seconds >= 0, or None for no timeout")
    return timeout


def check_request(priority: object, timeout: object, tenant: object) -> float | None:
    """Check a request's terms as a caller gave them; its timeout in seconds (None:
    none). The one check of every compute, run and lease (from any thread):
    InvalidArgumentError unless ``priority`` is an int (not a bool), ``timeout`` None or
    a real number >= 0 and ``tenant`` a str of valid UTF-8 (not a lone surrogate, which a
    Prometheus scrape could not write: see :mod:`wasinn._utf8`). A few type checks: it
    runs on every request."""
    if type(priority) is not int and (isinstance(priority, bool)
                                      or not hasattr(priority, "__index__")):
        raise InvalidArgumentError(
            f"priority {priority!r} ({type(priority).__name__}): expected an integer "
            "(higher runs first; default 0)")
    if type(tenant) is not str and not isinstance(tenant, str):
        raise InvalidArgumentError(
            f"tenant {tenant!r} ({type(tenant).__name__}): expected a str naming who "
            "the request is for (the fair queue policy shares device time among tenants)")
    if not tenant.isascii():  # (the check's own first step: saves its call per request)
        utf8_text("tenant", tenant)
    return None if timeout is None else check_timeout(timeout)


def request_deadline(priority: object, timeout: object, tenant: object) -> float:
    """:func:`check_request`, then the request's trio deadline (inf: none). In trio."""
    seconds = check_request(priority, timeout, tenant)
    if seconds is None:
        return math.inf
    try:
        now = trio.current_time()
    except RuntimeError:  # not in trio: say so as a request without a timeout does
        check_trio_run(None, A_REQUEST)
        raise
    return now + seconds


def naming_timeout(exc: TimeoutError_, timeout: float | None) -> WasiNNError:
    """``exc`` (a request's deadline passed) saying which ``timeout`` it was."""
    return exc.suffixed(f"(timeout={timeout:g} s)") if timeout is not None else exc


def _input_key(key: object) -> str | int:
    """An input key that is not a plain str or int: a str subclass or an integer type
    (numpy's) as its value; InvalidArgumentError for anything else (a float or a bool
    would match a position by equality)."""
    if isinstance(key, str):
        return str(key)
    if not isinstance(key, bool | np.bool_):
        try:
            return operator.index(key)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise InvalidArgumentError(
        f"input key {key!r:.60} ({type(key).__name__}): expected an input name (str) or "
        "position (int)")


def _input_name(key: object, executable: Executable) -> str:
    """The input name ``key`` stands for: a position's or an alias's name (UnknownNameError
    for a position the graph does not have, see :func:`spec_name`); any other str as it
    is (a name the graph does not list is the backend's to refuse, which can say what it
    is: an ONNX initializer, say)."""
    specs = executable.inputs
    if type(key) is int and 0 <= key < len(specs):  # (the usual position: at once)
        return specs[key].name
    plain = key if type(key) is str or type(key) is int else _input_key(key)
    aliases = executable.input_aliases
    if isinstance(plain, str) and not (aliases and plain in aliases):
        return plain
    return spec_name(specs, plain, "input", executable.name, aliases)


def _given_twice(inputs: GivenInputs, given: object, name: str, executable: Executable
                 ) -> InvalidArgumentError:
    """The error for input ``name`` given a second time, as ``given``: names both keys."""
    first = next(k for k in inputs if _input_name(k, executable) == name)
    return InvalidArgumentError(
        f"{executable.name}: input {name!r} is given twice (as {first!r} and {given!r}): "
        "expected each input once, by its name or its position")


def tensor_inputs(inputs: object, executable: Executable) -> Inputs:
    """``inputs`` (input names, aliases or positions -> values) as a request carries them
    to a device: keyed by ``executable``'s input names, every value a :class:`Tensor`
    (:func:`wasinn.tensor.as_tensor`). The mapping itself when it already is (str keys,
    none an alias, and Tensor values), else a new dict.

    Run before a request reaches a device, so that every backend is handed names, as
    ``CompiledGraph.run`` takes them, and a value with no tensor form is an
    InvalidArgumentError naming its input, not a failure of the backend's run. Raises
    InvalidArgumentError unless ``inputs`` is a mapping, for a key that is neither a str
    nor an integer, and for an input given twice (by name and position or alias);
    UnknownNameError (an InvalidArgumentError) for a position or alias the graph does not
    have.
    """
    # A dict first: the ABC check of Mapping is several Python calls, on every request.
    if type(inputs) is not dict and not isinstance(inputs, Mapping):
        raise InvalidArgumentError(
            f"inputs must be a mapping of input names or positions to tensors, "
            f"not {type(inputs).__name__}"
        )
    aliases = executable.input_aliases or None  # (most graphs have none)
    for key, value in inputs.items():
        if (type(value) is not Tensor or type(key) is not str
                or (aliases is not None and key in aliases)):
            break
    else:
        return inputs
    converted: dict[str, Tensor] = {}
    for given, value in inputs.items():
        key = _input_name(given, executable)
        if key in converted:
            raise _given_twice(inputs, given, key, executable)
        if type(value) is Tensor:
            converted[key] = value
            continue
        try:
            converted[key] = as_tensor(value)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"input {key!r}: {exc.message}") from None
    return converted


class ExecutionContext:
    """A lightweight ticket for running one graph (or pipeline) on ``target`` devices."""

    __slots__ = ("_bound", "_closed", "_executable", "_inputs", "_outputs", "_owner", "target")

    def __init__(self, executable: Executable, target: ExecutionTarget) -> None:
        executable.retain()
        self._executable = executable
        self.target = target
        self._inputs: dict[str, Tensor] | None = None
        self._outputs: dict[str, Tensor] | None = None
        self._bound: dict[str, OutputBuffer] | None = None
        self._closed = False
        # Who notes its requests waiting in device queues, withdrawn by close: made at
        # its first request (a context never used costs nothing more).
        self._owner: QueueOwner | None = None

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<ExecutionContext {self._executable.name} on {self.target.value} {state}>"

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedResourceError(
                f"the execution context of {self._executable.name} is closed"
            )

    @property
    def closed(self) -> bool:
        return self._closed

    # -- one call -----------------------------------------------------------------------
    @yields_when_refused
    async def compute(
        self,
        inputs: GivenInputs,
        *,
        priority: int = 0,
        timeout: float | None = None,
        tenant: str = "",
        keep_on_device: bool | None = None,
    ) -> dict[str, Tensor]:
        """Run on ``inputs`` (names or positions -> Tensor or numpy array); every output.

        Outputs bound with ``set_output`` are also written into their buffers, and all are
        kept for ``get_output``. ``priority`` (higher first) and ``timeout`` (seconds)
        order and bound the wait on a busy device; ``tenant`` names who the request is for
        (the ``fair`` queue policy). ``keep_on_device``: see the module docstring (None =
        native off the CPU, host on it). Values that are not Tensors are converted here
        (:func:`wasinn.tensor.as_tensor`: a copy for lists, non-contiguous arrays and
        arrays not in native byte order). An array that is not copied is read when the
        request runs, not when it is made: leave it unchanged until this returns (or
        pass a copy).

        Raises InvalidArgumentError for wrong inputs (naming what the model expects) or a
        bad ``priority`` (an int), ``timeout`` (seconds >= 0, or None) or ``tenant`` (a
        str); BackendRuntimeError when the backend fails, TimeoutError_ when ``timeout``
        passes, TooLargeError when the device's queue is full or a bound buffer is too
        small, ClosedResourceError after ``close`` or once the runtime is closed.
        Cancelling the caller drops a queued request, or abandons a running one (its
        result is discarded).

        A context closed (from another task) while its compute is in flight, as trio's
        streams do to an operation in progress: a request still waiting on the device (in
        its queue, in a batch that has not started, or for its graph's first compile
        there, which goes on) is withdrawn at once, unrun (ClosedResourceError saying so,
        counted as cancelled in the stats); one already running (in a batch that started,
        too) runs to its end, then raises ClosedResourceError and its outputs are
        dropped, neither recorded nor written into bound buffers (the caller learns that
        its result went nowhere instead of a success whose outputs the context no longer
        holds).
        """
        self._check_open()
        deadline = request_deadline(priority, timeout, tenant)
        bound = self._bound  # as bound now: set_output replaces the dict, never edits it
        executable = self._executable
        named = tensor_inputs(inputs, executable)
        token = QUEUE_OWNER.set(self._queue_owner())
        # Held by the request too, so that a close (the graph's last holder once it was
        # unloaded) between the request's slot and its run cannot free it under the run.
        executable.retain()
        try:
            outputs = await executable.execute(
                self.target, named, priority=priority, deadline=deadline, tenant=tenant,
                keep_on_device=keep_on_device,
            )
        except TimeoutError_ as exc:
            raise naming_timeout(exc, timeout) from exc
        finally:
            executable.release()
            QUEUE_OWNER.reset(token)
        self._record(outputs, bound)
        return outputs

    def _queue_owner(self) -> QueueOwner:
        # Who withdraws this context's queued requests when it closes (see compute).
        owner = self._owner
        if owner is None:
            owner = self._owner = QueueOwner()
        return owner

    def _record(self, outputs: dict[str, Tensor], bound: dict[str, OutputBuffer] | None
                ) -> None:
        # The outputs of a run that ended: kept for get_output, written into the buffers
        # that were bound when the request was made.
        if self._closed:  # closed while it ran: keep nothing (see compute)
            raise ClosedResourceError(
                f"the execution context of {self._executable.name} was closed while its "
                "request ran: the outputs were dropped")
        if bound:  # checks every buffer before it writes any: a refusal keeps the last
            fill(bound, outputs)  # outputs recorded, as a refused run does
        self._outputs = outputs

    def _staged(self) -> dict[str, Tensor]:
        # The staged inputs as they are now: a request made now must not see a later
        # set_input (one queued behind a busy device would run on it).
        return dict(self._inputs) if self._inputs else {}

    # -- in the caller's thread -------------------------------------------------------------
    @yields_when_refused
    async def lease(
        self,
        inputs: GivenInputs | None = None,
        *,
        priority: int = 0,
        timeout: float | None = None,
        tenant: str = "",
        keep_on_device: bool | None = None,
    ) -> ContextRun:
        """A request on ``inputs`` (None = the staged ones) for the caller's thread: when
        the device is free, return once a slot is held; the returned :class:`ContextRun`
        runs it in the caller's thread. On a busy device (or when the request joins a
        batch), the request runs in a device worker thread as :meth:`compute` runs it, and
        the ContextRun returned is settled: its ``run()`` returns the outputs at once (see
        the module docstring).

        Call it in trio. Raises what :meth:`compute` raises while placing and queueing
        (and, on a busy device, while running); cancelled while queued, the request is
        removed, and while it runs in a worker thread, it is abandoned. ``timeout`` bounds
        the wait and the run: a run still going when it passes is stopped where the
        backend can (see the module docstring) and raises TimeoutError_. A context closed
        while the request is queued withdraws it at once, as :meth:`compute` explains; one
        closed before :meth:`ContextRun.run` has the slot given back there, unrun
        (ClosedResourceError either way).
        """
        self._check_open()
        deadline = request_deadline(priority, timeout, tenant)
        if inputs is None:
            inputs = self._staged()
        bound = self._bound
        token = QUEUE_OWNER.set(self._queue_owner())
        try:
            lease = await self._executable.lease(
                self.target, tensor_inputs(inputs, self._executable), priority=priority,
                deadline=deadline, tenant=tenant, keep_on_device=keep_on_device,
            )
        except TimeoutError_ as exc:
            raise naming_timeout(exc, timeout) from exc
        finally:
            QUEUE_OWNER.reset(token)
        return ContextRun(self, lease, bound, timeout)

    def try_lease(self, inputs: GivenInputs | None = None, *, timeout: float | None = None,
                  tenant: str = "", keep_on_device: bool | None = None
                  ) -> ContextRun | None:
        """From the thread that owns this context (no trio): a :class:`ContextRun` holding
        a device slot, if the graph is compiled on the device it would run on and that
        device has a free slot and nobody queued (so nobody is overtaken); else None (use
        :meth:`lease`). ``tenant``: whom a fair pool charges the run to, as for
        :meth:`lease` (the request never queues, but its device time counts). Raises
        ClosedResourceError after ``close`` or once the runtime is closed,
        InvalidArgumentError for bad inputs (see :meth:`compute`), ``timeout`` or
        ``tenant``."""
        self._check_open()
        if inputs is None:
            inputs = self._staged()
        timeout = check_request(0, timeout, tenant)
        return self._try_lease(tensor_inputs(inputs, self._executable), timeout, tenant,
                               keep_on_device)

    def _try_lease(self, inputs: Inputs, timeout: float | None, tenant: str,
                   keep_on_device: bool | None) -> ContextRun | None:
        # try_lease on checked inputs, timeout and tenant.
        bound = self._bound
        lease = self._executable.try_lease(self.target, inputs, timeout=timeout,
                                           tenant=tenant, keep_on_device=keep_on_device)
        return None if lease is None else ContextRun(self, lease, bound, timeout)

    def compute_in_caller_thread(
        self,
        inputs: GivenInputs,
        *,
        priority: int = 0,
        timeout: float | None = None,
        tenant: str = "",
        keep_on_device: bool | None = None,
    ) -> dict[str, Tensor]:
        """:meth:`compute` from a thread that is not the trio thread (one started by
        ``trio.to_thread``, or any other): a free slot is taken here (:meth:`try_lease`) and
        the backend runs in this thread; on a busy device, the request is queued in trio
        (one ``trio.from_thread.run``, see :meth:`lease`). Same results and errors as
        :meth:`compute`, with the ``timeout`` caveat of :meth:`lease`; in a thread started
        by ``trio.to_thread`` in the runtime's trio run (a thread of another trio run is
        as one of the application's own), cancelling the trio task it belongs to drops a queued
        request, or abandons one running in a worker thread (``trio.Cancelled`` is raised
        here). Raises RuntimeError in the trio thread, whose event loop the run
        would block."""
        if trio.lowlevel.in_trio_run():
            raise RuntimeError(
                "compute_in_caller_thread runs the backend in the calling thread, and this "
                "is the trio thread, whose event loop it would block: await compute() "
                "instead, or call it from a worker thread (trio.to_thread.run_sync)")
        self._check_open()
        seconds = check_request(priority, timeout, tenant)
        inputs = tensor_inputs(inputs, self._executable)  # once, for both tries
        run = self._try_lease(inputs, seconds, tenant, keep_on_device)
        if run is None:
            queue = functools.partial(self.lease, inputs, priority=priority, timeout=timeout,
                                      tenant=tenant, keep_on_device=keep_on_device)
            token = self._executable.trio_token
            queued: ContextRun | None = None
            if _started_by_trio():

                async def queue_in_this_run() -> ContextRun | None:
                    # (None: the thread is another trio run's, not the runtime's.)
                    if trio.lowlevel.current_trio_token() is not token:
                        return None
                    return await queue()

                queued = trio.from_thread.run(queue_in_this_run)
            # A thread of the application's own, or of another trio run's: reach the
            # runtime's trio run.
            run = queued if queued is not None else self._queue_from_outside(queue)
        return run.run()  # a ContextRun: its timeout is named (see lease)

    def _queue_from_outside(self, queue: Callable[[], Awaitable[ContextRun]]) -> ContextRun:
        # A thread trio did not start (or another trio run's) has no task of the
        # runtime's run to be cancelled with: a trio run
        # that ends (its tasks cancelled, or finished) under its request means the
        # runtime went away, and says so as the runtime's close would.
        try:
            return trio.from_thread.run(queue, trio_token=self._executable.trio_token)
        except (trio.Cancelled, trio.RunFinishedError):
            raise ClosedResourceError(
                f"{self._executable.name}: the trio run serving the runtime ended while "
                "the request was queued") from None

    def run_in_caller_thread(self, *, priority: int = 0, timeout: float | None = None,
                             tenant: str = "") -> None:
        """The staged :meth:`run`, from a thread started by ``trio.to_thread`` (see
        :meth:`compute_in_caller_thread`)."""
        self.compute_in_caller_thread(self._staged(), priority=priority, timeout=timeout,
                                      tenant=tenant)

    # -- the staged form (wasi-nn) ------------------------------------------------------
    def set_input(self, key: str | int, value: Tensor | Any) -> None:
        """Stage input ``key`` (a name or position) for ``run``.

        A Tensor, or a C-contiguous numpy array in native byte order, is kept as it is
        (not copied: change it before ``run`` and the run sees the change); anything else
        is converted now (:func:`wasinn.tensor.as_tensor`: a copy for lists,
        non-contiguous arrays and arrays not in native byte order). Raises
        InvalidArgumentError for an unknown key or a value with no wasi-nn tensor form.
        """
        self._check_open()
        name = spec_name(self._executable.inputs, key, "input", self._executable.name,
                         self._executable.input_aliases)
        if self._inputs is None:
            self._inputs = {}
        try:
            self._inputs[name] = as_tensor(value)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"input {name!r}: {exc.message}") from None

    def set_output(self, key: str | int, buffer: Any) -> None:
        """Bind a writable host buffer that ``run``/``compute`` fill with output ``key``.

        A byte buffer (``bytearray``, ``memoryview``, ``uint8`` array) receives the
        output's bytes and may be larger; a typed numpy array must have the output's
        dtype and shape (checked at each run, before any bound buffer is written: see
        :mod:`wasinn.scheduler.binding`). Raises InvalidArgumentError for an unknown key,
        a read-only/non-contiguous buffer or a dtype with no wasi-nn element type.
        """
        self._check_open()
        name = spec_name(self._executable.outputs, key, "output", self._executable.name,
                         self._executable.output_aliases)
        # A new dict: requests already made keep the buffers bound when they were made.
        self._bound = {**(self._bound or {}), name: OutputBuffer(name, buffer)}

    @yields_when_refused
    async def run(self, *, priority: int = 0, timeout: float | None = None,
                  tenant: str = "") -> None:
        """Run on the staged inputs (see :meth:`compute` for what is raised)."""
        self._check_open()
        await self.compute(self._staged(), priority=priority, timeout=timeout,
                           tenant=tenant)

    def get_output(self, key: str | int) -> Tensor:
        """Output ``key`` (a name or position) of the last run.

        Raises InvalidArgumentError before the first run or for an unknown key.
        """
        self._check_open()
        name = spec_name(self._executable.outputs, key, "output", self._executable.name,
                         self._executable.output_aliases)
        if self._outputs is None:
            raise InvalidArgumentError(
                f"{self._executable.name}: no outputs yet: call run() or compute() first"
            )
        try:
            return self._outputs[name]
        except KeyError:
            raise InvalidArgumentError(
                f"{self._executable.name}: output {name!r} was not produced by the last run"
            ) from None

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Finalize the context; idempotent. Synchronous, and may be called from another
        task than the one computing: its requests still waiting on a device (in its
        queue, in a batch that has not started, for their graph's compile) are withdrawn
        at once, unrun (their callers raise ClosedResourceError saying so; the stats
        count them cancelled), while a request already running ends its run and is
        dropped (see :meth:`compute`). The graph's compiled sessions are freed when the
        graph is unloaded and its last context is closed.

        Any thread may call it: from one outside the runtime's trio thread (the
        application's own, or a worker thread), the context is closed at once (its
        calls raise ClosedResourceError) and the withdrawal and release are handed to
        the runtime's trio run, which does them next."""
        if self._closed:
            return
        self._closed = True
        self._inputs = self._outputs = self._bound = None
        owner, self._owner = self._owner, None
        token = self._executable.trio_token
        if token is None or _in_run_of(token):
            self._finalize(owner)
            return
        try:
            token.run_sync_soon(self._finalize, owner)
        except trio.RunFinishedError:  # (the runtime's run is over: no task left to wake)
            self._executable.release()

    def _finalize(self, owner: QueueOwner | None) -> None:
        # In the runtime's trio thread (withdrawing wakes trio tasks; the reference
        # count is trio's): withdraw the requests still waiting, then let the graph go.
        try:
            if owner is not None:
                # (Each request's error adds where it waited: the queue, a batch, a
                # compile.)
                owner.withdraw_all(
                    f"the execution context of {self._executable.name} was closed")
        finally:
            self._executable.release()

    def __enter__(self) -> ExecutionContext:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _in_run_of(token: trio.lowlevel.TrioToken) -> bool:
    """Whether this is the trio thread of the run ``token`` belongs to."""
    return trio.lowlevel.in_trio_run() and trio.lowlevel.current_trio_token() is token


def _started_by_trio() -> bool:
    """Whether this thread was started by ``trio.to_thread`` (it then belongs to a trio
    task, whose cancellation reaches it). Raises ``trio.Cancelled`` if that task is."""
    try:
        trio.from_thread.check_cancelled()
    except RuntimeError:  # "this thread wasn't created by Trio"
        return False
    return True


class ContextRun:
    """A request on an :class:`ExecutionContext` that holds a device slot and is run by
    the caller's own thread (see :meth:`ExecutionContext.lease`), or, settled, one that
    has already run in a device worker thread. End it with :meth:`run` or :meth:`cancel`:
    one dropped unended gives its slot back only when collected, with a ResourceWarning."""

    __slots__ = ("_bound", "_ctx", "_lease")

    def __init__(self, ctx: ExecutionContext, lease: Lease[dict[str, Tensor]],
                 bound: dict[str, OutputBuffer] | None, timeout: float | None = None
                 ) -> None:
        self._ctx = ctx
        self._lease = lease
        self._bound = bound
        lease.timeout = timeout  # the request's, named when it passes

    def run(self) -> dict[str, Tensor]:
        """Run the model in this thread (never the trio thread: it would block the loop),
        give the slot back, and record the outputs on the context (``get_output``, bound
        buffers) as :meth:`ExecutionContext.compute` does. Once only. Raises what
        ``compute`` raises for a failed run; ClosedResourceError when the context was
        closed before the run (the slot is given back without running) or during it
        (the outputs are dropped, as :meth:`ExecutionContext.compute` explains)."""
        ctx = self._ctx
        if ctx._closed:
            self._lease.cancel()
            raise ClosedResourceError(
                f"the execution context of {ctx._executable.name} is closed: the request "
                "was not run")
        outputs = self._lease.run()
        ctx._record(outputs, self._bound)
        return outputs

    def cancel(self) -> None:
        """Give the slot back without running. Idempotent."""
        self._lease.cancel()

    def interrupt(self) -> None:
        """Stop the run while it runs (from any other thread) where the backend can:
        :meth:`run` then raises BackendRuntimeError. Idempotent."""
        self._lease.interrupt()
