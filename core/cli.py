"""The ``wasinn`` command.

::

    wasinn run [--config FILE] [--dir HOST[::GUEST]]... [--env K[=V]]... [--[no-]sandbox]
               [--timeout SECONDS] [--fuel N] [--metrics-port PORT [--metrics-addr ADDR]]
               [--nn-preload NAME:ENCODING:TARGET:PATH[:PATH...]]...
               [--wasi nn-graph=ENCODING::DIR]... GUEST.wasm [ARGS...]
    wasinn infer [--config FILE] [--nn-preload ...] NAME [--input NAME=FILE.npy]... [--zeros]
                 [--requests N] [--concurrency C] [--save FILE.npz] ...
                                       run a registered model or pipeline (wasinn.infer)
    wasinn devices [--config FILE]     the devices and backends found, as a table
    wasinn models [--config FILE]      the model registry
    wasinn demo                        generate a model, build the C classifier, run it

``-v`` logs progress and timing (model load, guest compile and run times, and at the
end each device's requests by outcome and their latency percentiles), ``-vv``
every wasi-nn call with its time. ``run`` exits with the guest's exit code; a guest
trap prints its message and exits with 134; an error before the guest starts prints
``wasinn: error: ...`` and exits with 1 (2 for a malformed command line). A command
whose stdout's reader has gone (``wasinn devices | head -1``) stops quietly with 141, the
shell's status for a process that SIGPIPE ended. Ctrl-C stops a command with 130, and
SIGTERM (what systemd, ``docker stop`` and Kubernetes send) the same way with 143: the
guest is stopped and every model, sandbox process and private folder released; a second
such signal exits at once. A load test (``infer --requests N``) so stopped prints what it
measured until then.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import logging
import os
import signal
import sys
import threading
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from wasinn._abandoned import unfinished_work
from wasinn._cli_parser import METRICS_ADDR, build_parser
from wasinn._cli_startup import import_holding_ctrl_c, open_closed_standard_fds
from wasinn.errors import InvalidArgumentError, UnsupportedOperationError, WasiNNError

if TYPE_CHECKING:
    import trio

    from wasinn.actors.stats import DeviceStats
    from wasinn.configs.schema import RuntimeConfig
    from wasinn.host.preload import Preload
    from wasinn.infer import InferReport
    from wasinn.scheduler import Runtime

log = logging.getLogger("wasinn.cli")

#: Exit status when wasinn itself fails before or around the guest.
EXIT_ERROR = 1
#: Exit status after a Ctrl-C (SIGINT), as a shell reports a process it ended: 128 + 2.
EXIT_INTERRUPTED = 130
#: Exit status after SIGTERM, what systemd, ``docker stop`` and Kubernetes send to stop a
#: process: 128 + 15, as a shell reports a process that SIGTERM ended. The command stops
#: as after Ctrl-C: every ``finally`` and close runs.
EXIT_TERMINATED = 143
#: The signals that stop a command gracefully: how messages name each, and the exit
#: status after it.
_STOP_SIGNALS = {signal.SIGINT: ("Ctrl-C", EXIT_INTERRUPTED),
                 signal.SIGTERM: ("SIGTERM", EXIT_TERMINATED)}
#: Exit status when stdout's reader has gone (``wasinn devices | head -1``), as a shell
#: reports a process that SIGPIPE ended: 128 + 13. Nothing is said.
EXIT_BROKEN_PIPE = 141


class UsageError(Exception):
    """A command-line value that cannot be used (exit status 2, like argparse)."""


def parse_dir(spec: str) -> tuple[str, str]:
    """``--dir`` as (guest path, host path).

    ``HOST::GUEST`` (Wasmtime), ``HOST`` alone (same name in the guest, as Wasmtime does),
    or ``GUEST:HOST`` (WasmEdge's single colon).
    """
    if "::" in spec:
        host, _, guest = spec.partition("::")
    elif ":" in spec:
        guest, _, host = spec.partition(":")
    else:
        host = guest = spec
    if not host or not guest:
        raise UsageError(f"--dir {spec!r}: expected HOST[::GUEST] or GUEST:HOST")
    return guest, host


def parse_dirs(specs: Sequence[str]) -> dict[str, str]:
    """Every ``--dir`` as {guest path: host path}; UsageError for a guest path given two
    host directories, one of which the guest would never see."""
    dirs: dict[str, str] = {}
    for spec in specs:
        guest, host = parse_dir(spec)
        if dirs.setdefault(guest, host) != host:
            raise UsageError(f"--dir {spec!r}: the guest path {guest!r} is already "
                             f"{dirs[guest]!r}: expected one host directory per guest path")
    return dirs


def parse_env(spec: str) -> tuple[str, str]:
    """``--env K=V``; ``--env K`` passes the host's value of K (Wasmtime's behaviour)."""
    key, sep, value = spec.partition("=")
    if not key:
        raise UsageError(f"--env {spec!r}: expected KEY=VALUE or KEY")
    if not sep:
        if key not in os.environ:
            raise UsageError(f"--env {key}: not set in the host environment; use KEY=VALUE")
        value = os.environ[key]
    return key, value


def parse_envs(specs: Sequence[str]) -> dict[str, str]:
    """Every ``--env`` as {name: value}; UsageError for a name given two values (the
    same one twice counts once), one of which the guest would never see."""
    env: dict[str, str] = {}
    for spec in specs:
        key, value = parse_env(spec)
        if env.setdefault(key, value) != value:
            raise UsageError(f"--env {spec!r}: {key} is already {env[key]!r}: expected one "
                             "value per variable")
    return env


def _configure_logging(verbose: int) -> None:
    if verbose <= 0:
        return
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr,
        format="[%(relativeCreated)8.1f ms] %(name)s: %(message)s")
    logging.getLogger("wasinn").setLevel(logging.DEBUG if verbose > 1 else logging.INFO)


def _load_config(path: str | None) -> RuntimeConfig:
    from wasinn.configs.loader import load_config, packaged_config

    return load_config(path) if path else packaged_config()


def _registry_config(args: argparse.Namespace) -> RuntimeConfig:
    """``--config``'s registry, with the models ``--nn-preload`` and ``--wasi`` add
    (parsed already: :func:`_parse_values`), each checked as a config's model is
    (InvalidArgumentError, ConfigError naming the flag)."""
    from wasinn.host.preload import with_preloads

    for preload in args.preloads:
        _check_preload(preload.flag, preload)
    return with_preloads(_load_config(args.config), args.preloads)


def _parse_values(args: argparse.Namespace) -> None:
    """Parse the options whose values have a syntax of their own, before anything
    starts: one that cannot be parsed is a usage error (status 2, as argparse's own),
    not a failure of the run (1)."""
    if getattr(args, "metrics_addr", None) is not None and args.metrics_port is None:
        raise UsageError(f"--metrics-addr {args.metrics_addr}: expected --metrics-port PORT "
                         "too (the port to serve the metrics on)")
    try:
        if hasattr(args, "nn_preload"):
            args.preloads = _preloads(args)
        if args.command == "infer":
            from wasinn.infer import Load, check_input_specs, parse_shapes

            args.load = Load(args.requests, args.concurrency, args.timeout)
            args.shapes = parse_shapes(args.shape)
            check_input_specs(args.input)
    except InvalidArgumentError as exc:
        raise UsageError(exc.message) from None


def _preloads(args: argparse.Namespace) -> list[Preload]:
    """The models ``--nn-preload`` and ``--wasi nn-graph`` register (InvalidArgumentError
    for a malformed one, or a name given twice)."""
    from wasinn.host.preload import parse_nn_graph, parse_nn_preload

    given = [(f"--nn-preload {s!r}", parse_nn_preload(s)) for s in args.nn_preload]
    for spec in args.wasi:
        items = spec.split(",")  # (Wasmtime's -S nn,nn-graph=openvino::DIR)
        for item in items:
            if item.strip() in ("nn", "nn=y", "nn=true", "common", "common=y"):
                continue  # wasi-nn and WASI are always on
            try:
                given.append((f"--wasi {spec!r}", parse_nn_graph(item)))
            except InvalidArgumentError as exc:
                if len(items) == 1:
                    raise
                raise exc.suffixed(
                    f"(in --wasi {spec!r}, whose commas separate items, as Wasmtime's -S "
                    "does: a folder whose path holds a comma can be given with "
                    "--nn-preload)") from None
    chosen: dict[str, Preload] = {}
    for flag, preload in given:
        earlier = chosen.setdefault(preload.name, preload)
        if earlier != preload:  # (equal: the same model given again, in any letter case)
            # A second one would silently replace the first for every guest.
            raise InvalidArgumentError(
                f"{flag}: the name {preload.name!r} is already given by {earlier.flag}: "
                "expected each name once")
    return list(chosen.values())


def _check_preload(flag: str, preload: Preload) -> None:
    # Here, not when the runtime checks the merged config: its error would name the
    # config file (or the installed default.toml) for what only the command line gave.
    from wasinn.configs.loader import parse_config

    model = {"files": [str(p.absolute()) for p in preload.paths],
             "encoding": preload.encoding.value}
    parse_config({"models": {preload.name: model}}, None, label=flag, backends=())


class _Stop:
    """What :func:`_stopped_by` yields: the scope its signals cancel, and the first stop
    signal that came while it ran (None: none yet), whether it took that signal itself
    or a scope inside it did (:meth:`take`). ``outer`` is the stop of the scope around
    it (None: none)."""

    def __init__(self, scope: trio.CancelScope, outer: _Stop | None = None) -> None:
        self.scope = scope
        self.outer = outer
        self.signum: signal.Signals | None = None

    def take(self, signum: signal.Signals) -> None:
        """Record ``signum`` as the first signal here and in every scope around this one
        that has none yet, without cancelling them: the next signal any of them takes
        (the one listening when this scope has ended) then exits at once."""
        stop: _Stop | None = self
        while stop is not None and stop.signum is None:
            stop.signum = signum
            stop = stop.outer

    @property
    def stopped(self) -> bool:
        """Whether a signal stopped the block (its scope caught the cancellation)."""
        return self.scope.cancelled_caught

    @property
    def name(self) -> str:
        """The signal as messages name it ("Ctrl-C", "SIGTERM")."""
        return _STOP_SIGNALS[self.signum][0] if self.signum is not None else ""

    @property
    def status(self) -> int:
        """The command's exit status after the signal (130, 143)."""
        return _STOP_SIGNALS[self.signum][1] if self.signum is not None else EXIT_ERROR


#: Set once a stop signal came to the command that :func:`main` runs (cleared as it
#: starts): the command then exits past the work it abandoned (see :func:`main`).
_stop_signal_taken = threading.Event()

#: The stop of the innermost :func:`_stopped_by` scope the current task runs in (None:
#: none), which a scope opened inside it takes as its ``outer``. A context variable, not
#: a global: it is set in the command's own task, and every ``trio.run`` (every
#: in-process ``main()`` call) starts from a copy of its caller's context.
_enclosing_stop: contextvars.ContextVar[_Stop | None] = contextvars.ContextVar(
    "_enclosing_stop", default=None)


@contextlib.asynccontextmanager
async def _stopped_by(*signums: signal.Signals) -> AsyncIterator[_Stop]:
    """A scope that any of ``signums`` (of :data:`_STOP_SIGNALS`) cancels: what runs in
    it is cancelled, and every ``finally`` and close on the way out runs (a runtime's
    close, which removes its sandbox processes' private folders, is shielded). Another
    such signal while it stops exits at once, with that signal's status: also once the
    signal came to a scope inside this one (a guest's, which has ended and left this
    one listening while the runtime closes), since the signal a scope takes is recorded
    in every scope around it (:meth:`_Stop.take`). Outside the main thread, which alone
    is told of signals, a scope that nothing cancels."""
    import trio

    with trio.CancelScope() as scope:
        # (Read here, in the caller's task: the watcher below is a system task, which
        # runs in a context of its own.)
        stop = _Stop(scope, _enclosing_stop.get())
        if threading.current_thread() is not threading.main_thread():
            yield stop
            return
        with trio.open_signal_receiver(*signums) as signals:

            async def watch() -> None:
                async for number in signals:
                    signum = signal.Signals(number)
                    name, status = _STOP_SIGNALS[signum]
                    if stop.signum is not None:
                        _exit_now(f"a second {name}" if signum is stop.signum
                                  else f"{name} after {stop.name}", status)
                    stop.take(signum)
                    _stop_signal_taken.set()
                    scope.cancel()

            watching = trio.CancelScope()

            async def watch_until_done() -> None:
                # (it may first run once the block has ended, its receiver closed: a
                # command that failed before its first checkpoint)
                with watching:
                    if not watching.cancel_called:
                        await watch()

            # A system task, not a nursery: the block's own errors (a guest's trap)
            # reach the caller as they are, not in an exception group.
            trio.lowlevel.spawn_system_task(watch_until_done)
            enclosing = _enclosing_stop.set(stop)
            try:
                yield stop
            finally:
                _enclosing_stop.reset(enclosing)
                watching.cancel()


@contextlib.asynccontextmanager
async def _guest_stopped() -> AsyncIterator[_Stop]:
    """A scope that Ctrl-C or SIGTERM cancels around a guest: the guest is stopped and
    its models released, and the command exits with 130 (143 after SIGTERM). A guest
    blocked in a host call that its cancellation cannot reach (a component's WASI
    sleep) is given up on by ``run_wasm`` itself
    :data:`~wasinn.host.guest_thread.STOP_GRACE_S` seconds later: its thread is
    abandoned (a daemon thread, which does not hold the process's exit), and the command
    says so and exits. A second signal exits at once."""
    from wasinn.host.guest_thread import STOP_GRACE_S, abandoned_guest_threads

    async with _stopped_by(signal.SIGINT, signal.SIGTERM) as stop:
        abandoned_before = abandoned_guest_threads()
        try:
            yield stop
        finally:
            if stop.signum is not None and abandoned_guest_threads() > abandoned_before:
                print(f"wasinn: the guest did not stop within {STOP_GRACE_S:g} s of "
                      f"{stop.name} (it is blocked in a host call, such as a component's "
                      "WASI sleep): exiting", file=sys.stderr)


async def _terminable(command: Callable[[argparse.Namespace], Awaitable[int]],
                      args: argparse.Namespace) -> int:
    """``command(args)``, stopped by Ctrl-C or SIGTERM (see :func:`_stopped_by`): its
    status, or the signal's (:data:`EXIT_INTERRUPTED`, :data:`EXIT_TERMINATED`) once one
    came, to this scope or to one of the command's own (``run``'s guest, ``infer``'s
    runtime). After a signal one of those took, the next one, which comes here once the
    command's scope has ended (while ``run``'s runtime closes), exits at once."""
    async with _stopped_by(signal.SIGINT, signal.SIGTERM) as stop:
        status = await command(args)
    return stop.status if stop.signum is not None else status


def _exit_now(why: str, status: int = EXIT_INTERRUPTED) -> None:
    print(f"wasinn: {why}: exiting", file=sys.stderr, flush=True)
    os._exit(status)


async def _run(args: argparse.Namespace) -> int:
    from wasinn.host.runner import TRAP_EXIT_STATUS, GuestTrap
    from wasinn.scheduler import Runtime

    dirs = parse_dirs(args.dir)
    env = parse_envs(args.env)
    guest = Path(args.guest)
    if not guest.is_file():
        said = "not a file" if guest.exists() else "no such file"
        raise InvalidArgumentError(
            f"{args.guest}: {said}: expected a guest module (.wasm, or .wat text)")
    config = _registry_config(args)
    overrides = {key: value for key, value in (("sandbox", args.sandbox),
                                               ("run_timeout", args.timeout),
                                               ("max_fuel", args.fuel))
                 if value is not None}
    if overrides:
        guests = config.guests.model_copy(update=overrides)
        config = config.model_copy(update={"guests": guests})
    rt = Runtime(config)
    # (Served from before the start, whose preloads may take a while, to after the close.)
    async with _serving_metrics(rt, args.metrics_port, args.metrics_addr), rt:
        try:
            # A guest past its run_timeout that cannot be stopped (blocked in a host
            # call) is given up on by run_wasm after its grace: GuestTrap all the same.
            async with _guest_stopped() as stop:
                code = await rt.run_wasm(args.guest, argv=args.args, dirs=dirs, env=env,
                                         stdin="inherit")
            return stop.status if stop.stopped else code
        except GuestTrap as trap:
            print(f"wasinn: {trap.message}", file=sys.stderr)
            return TRAP_EXIT_STATUS
        finally:
            # -v: what each registry model, tenant and device did for the guest
            for line in [*(s.describe() for s in rt.model_stats()),
                         *(s.describe() for s in rt.tenant_stats()),
                         *(s.describe() for s in rt.stats())]:
                log.info("%s", line)


@contextlib.asynccontextmanager
async def _serving_metrics(rt: Runtime, port: int | None, addr: str | None
                           ) -> AsyncIterator[None]:
    """``--metrics-port``: ``rt``'s figures served to Prometheus, in a registry of their
    own, until the block ends (see :class:`wasinn.scheduler.metrics.MetricsServer`);
    nothing without a port. UnsupportedOperationError without prometheus-client, OSError
    naming the address and port where the server cannot listen."""
    import trio

    if port is None:
        yield
        return
    try:
        from wasinn.scheduler.metrics import MetricsServer
    except ImportError as exc:
        raise UnsupportedOperationError(f"--metrics-port: {exc}") from None
    server = await trio.to_thread.run_sync(MetricsServer, rt, port, addr or METRICS_ADDR)
    if port == 0:  # (who scrapes must be told which)
        print(f"wasinn: serving metrics at {server.url}", file=sys.stderr, flush=True)
    else:
        log.info("serving metrics at %s", server.url)
    async with server:
        yield


async def _infer(args: argparse.Namespace) -> int:
    from wasinn._save import check_save_path, goes_to_stdout, save_outputs
    from wasinn.infer import Load, LoadTally, describe_output, infer, read_inputs
    from wasinn.scheduler import Runtime

    load: Load = args.load
    shapes = args.shapes
    given = read_inputs(args.input)
    # --save /dev/stdout: the archive is all that stdout's reader gets (numpy.load reads
    # it), so every line printed goes to stderr.
    lines_to = sys.stdout
    if args.save:
        check_save_path(Path(args.save))
        if goes_to_stdout(Path(args.save)):
            lines_to = sys.stderr
    tally = LoadTally()
    # Stopped here, not in _terminable's scope, to print what a load test measured. Its
    # graph's unload is cancelled: only the runtime's close waits for a run that ignores
    # cancellation (close_timeout), and a second signal exits at once.
    async with (_stopped_by(signal.SIGINT, signal.SIGTERM) as stop,
                Runtime(_registry_config(args)) as rt):
        report = await infer(rt, args.name, given, zeros=args.zeros, shapes=shapes,
                             target=args.target, load=load, tally=tally)
        stats = rt.stats()
    if stop.stopped:
        if load.requests > 1:  # (no outputs printed nor saved: the run did not end)
            print(f"stopped by {stop.name} after {tally.completed} of {load.requests} "
                  "requests", file=lines_to)
            if tally.completed:
                _print_load(tally.report(), rt.stats(), lines_to)
        return stop.status
    for name, tensor in report.outputs.items():
        print(describe_output(name, tensor), file=lines_to)
    if load.requests > 1:
        _print_load(report, stats, lines_to)
    if args.save:
        save_outputs(Path(args.save), report.outputs)
        print(f"outputs written to {args.save}", file=lines_to)
    return 0


def _print_load(report: InferReport, stats: Sequence[DeviceStats], to: TextIO) -> None:
    # A load test's figures: the callers' rate and latencies, the model's stats and
    # those of each device that finished requests.
    print(report.describe_load(), file=to)
    print(report.model.describe(), file=to)
    for device in stats:
        if device.finished:
            print(device.describe(), file=to)


async def _devices(args: argparse.Namespace) -> int:
    from wasinn._cli_listings import print_devices

    await print_devices(_load_config(args.config))
    return 0


def _models(args: argparse.Namespace) -> int:
    from wasinn._cli_listings import print_models

    print_models(_registry_config(args), args.config or "the embedded default config")
    return 0


async def _demo(args: argparse.Namespace) -> int:
    from wasinn.host.demo import run_demo

    workdir = Path(args.workdir) if args.workdir else None
    return await run_demo(width=args.width, workdir=workdir)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``wasinn`` console script; returns the exit status. A Ctrl-C
    from the start, while the command line is parsed too, exits quietly with 130.

    A command that a signal stopped while work it abandoned still runs in a worker
    thread (a backend library's import, a model's export: :mod:`wasinn._abandoned`) does
    not return: the process exits at once with the status, its output flushed, since the
    interpreter's normal exit would destroy that library's objects under the work and
    abort."""
    _stop_signal_taken.clear()
    try:
        open_closed_standard_fds()
        if import_holding_ctrl_c():
            return EXIT_INTERRUPTED
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command == "run" and args.guest is None:
            args.command_parser.error("the following arguments are required: GUEST.wasm")
        _configure_logging(args.verbose)
        status = _main(parser, args)
    except KeyboardInterrupt:
        _stop_signal_taken.set()
        status = EXIT_INTERRUPTED
    # (Only after a signal: a program calling main() with work of its own abandoned
    # elsewhere must get the status back.)
    if _stop_signal_taken.is_set() and unfinished_work():
        log.info("exiting past %d abandoned job(s) still running in worker threads",
                 unfinished_work())
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(AttributeError, OSError, ValueError):  # (None, closed)
                stream.flush()
        os._exit(status)
    return status


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run the command ``args`` (parsed by ``parser``) names: its exit status, after
    saying what failed (:func:`main`)."""
    try:
        _parse_values(args)
        with _warning_lines():
            status = _command(args)
        if sys.stdout is not None:  # (None: started without one that Python could use)
            sys.stdout.flush()  # (a closed stdout is met here, not at the interpreter's exit)
        return status
    except UsageError as exc:  # with the subcommand's usage line
        getattr(args, "command_parser", parser).error(str(exc))
    except BrokenPipeError as exc:  # (an OSError: before _FAILURES)
        if _stdout_closed():
            _stop_writing()
            return EXIT_BROKEN_PIPE
        _say(exc)
        return EXIT_ERROR
    except _FAILURES as exc:
        _say(exc)
        return EXIT_ERROR
    except KeyboardInterrupt:
        _stop_signal_taken.set()
        return EXIT_INTERRUPTED
    except BaseExceptionGroup as group:
        # What trio's nurseries raise: a Ctrl-C, or the errors of tasks run side by side.
        if group.subgroup(KeyboardInterrupt) is not None:
            _stop_signal_taken.set()
            return EXIT_INTERRUPTED
        failures, rest = group.split(_FAILURES)
        if failures is None or rest is not None:
            raise
        leaves = _leaves(failures)
        said = [f for f in leaves if not (isinstance(f, BrokenPipeError) and _stdout_closed())]
        for failure in said:
            _say(failure)
        if len(said) < len(leaves):  # a print met a closed stdout
            _stop_writing()
            if not said:
                return EXIT_BROKEN_PIPE
        return EXIT_ERROR
    return EXIT_ERROR  # pragma: no cover - parser.error exits


@contextlib.contextmanager
def _warning_lines() -> Iterator[None]:
    """Within: wasinn's warnings are printed as the command's other lines are,
    ``wasinn: warning: TEXT``, after the guest's name where a guest's request caused it
    (``wasinn: warning: classify.wasm: no gpu device here ...``): the line of Python
    that raised it means nothing to the command's user. Other warnings print as usual."""
    shown = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        text = str(message)
        if not (text.startswith("wasinn: ") or category.__module__.startswith("wasinn.")):
            shown(message, category, filename, lineno, file, line)
            return
        guest = f"{filename}: " if lineno == 0 else ""  # (a guest has no line)
        print(f"wasinn: warning: {guest}{text.removeprefix('wasinn: ')}",
              file=file or sys.stderr, flush=True)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def _command(args: argparse.Namespace) -> int:
    """Run the command ``args`` names; its exit status."""
    import trio

    if args.command == "models":
        return _models(args)
    command = {"run": _run, "infer": _infer, "devices": _devices}.get(args.command, _demo)
    return int(trio.run(_terminable, command, args))


def _stdout_closed() -> bool:
    """Whether stdout is a pipe (or socket) whose reader has gone, as after
    ``wasinn devices | head -1``: where a BrokenPipeError came from a print, not from
    another pipe of the command's (a sandbox process's), which stays an error."""
    import select

    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
    except (AttributeError, OSError, ValueError):  # (no poll(); stdout replaced or closed)
        return False
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _stop_writing() -> None:
    """Point stdout, whose reader has gone, at /dev/null: the command then ends quietly
    (:data:`EXIT_BROKEN_PIPE`), as one that SIGPIPE ends does, since the reader asked for
    no more, and the interpreter's last flush does not report the same pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


#: What ends a command with ``wasinn: error: ...`` and status 1.
_FAILURES = (WasiNNError, OSError, RuntimeError)


def _say(exc: BaseException) -> None:
    message = exc.message if isinstance(exc, WasiNNError) else str(exc)
    print(f"wasinn: error: {message}", file=sys.stderr)


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    # The exceptions a (nested) group holds, in order.
    leaves: list[BaseException] = []
    for exc in group.exceptions:
        leaves += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return leaves


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
