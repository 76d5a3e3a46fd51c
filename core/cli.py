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
``wasinn: error: ...`` and exits with 1 (2 for a malformed command line).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from wasinn.enums import ExecutionTarget
from wasinn.errors import InvalidArgumentError, UnsupportedOperationError, WasiNNError

if TYPE_CHECKING:
    import trio

    from wasinn.configs.schema import ModelConfig, PipelineConfig, RuntimeConfig
    from wasinn.host.preload import Preload
    from wasinn.scheduler import Runtime

log = logging.getLogger("wasinn.cli")

#: Exit status when wasinn itself fails before or around the guest.
EXIT_ERROR = 1
#: Exit status after a Ctrl-C (SIGINT), as a shell reports a process it ended: 128 + 2.
EXIT_INTERRUPTED = 130
#: The most fuel ``--fuel`` may give (wasmtime counts fuel in a u64).
MAX_FUEL = 2**64 - 1
#: Where ``--metrics-port`` listens unless ``--metrics-addr`` says: this machine only.
METRICS_ADDR = "127.0.0.1"


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


def _parser() -> argparse.ArgumentParser:
    # -v is accepted before and after the command; SUPPRESS keeps the subcommand's
    # parser from resetting a count given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                        help="progress and timing (-vv: every wasi-nn call)")
    config = argparse.ArgumentParser(add_help=False)
    config.add_argument("--config", metavar="FILE",
                        help="runtime config (TOML); default: the embedded default")

    parser = argparse.ArgumentParser(
        prog="wasinn",
        description="Run wasi-nn WebAssembly guests on an async multi-device scheduler.")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="progress and timing (-vv: every wasi-nn call)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    registry = argparse.ArgumentParser(add_help=False, parents=[config])
    registry.add_argument("--nn-preload", action="append", default=[],
                          metavar="NAME:ENCODING:TARGET:PATH[:PATH...]",
                          help="register a model for load_by_name (WasmEdge syntax)")
    registry.add_argument("-S", "--wasi", action="append", default=[],
                          metavar="nn-graph=ENCODING::DIR",
                          help="register DIR's model under DIR's name (Wasmtime syntax; "
                               "-S nn is accepted: wasi-nn is always on)")

    run = sub.add_parser("run", parents=[common, registry], help="run a guest (.wasm or .wat)",
                         description="Run a core-module or component guest to completion.",
                         usage="wasinn run [options] GUEST.wasm [ARGS ...]")
    run.add_argument("--dir", action="append", default=[], metavar="HOST[::GUEST]",
                     help="preopen a host directory (GUEST:HOST also accepted)")
    run.add_argument("--env", action="append", default=[], metavar="K[=V]",
                     help="set a guest environment variable")
    sandbox = run.add_mutually_exclusive_group()
    sandbox.add_argument("--sandbox", action="store_const", const=True, default=None,
                         help="run each model the guest loads from its own bytes in a "
                              "process of its own on every device, not only the CPU "
                              "([guests] sandbox = true)")
    sandbox.add_argument("--no-sandbox", dest="sandbox", action="store_const", const=False,
                         help="run the models the guest loads from its own bytes in this "
                              "process ([guests] sandbox = false): faster, but a library "
                              "crash on the guest's model or inputs ends the run")
    run.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                     help="stop the guest if it runs longer (a trap: status 134; "
                          "[guests] run_timeout)")
    run.add_argument("--fuel", type=_fuel, metavar="N",
                     help="stop the guest once it has executed N units of wasm fuel (about "
                          "one an instruction; a trap: status 134; wasi-nn calls use none; "
                          "[guests] max_fuel)")
    run.add_argument("--metrics-port", type=_port, metavar="PORT",
                     help="serve the run's figures (devices, models, tenants) to Prometheus "
                          "at http://ADDR:PORT/metrics while it runs; 0: a free port, "
                          "printed (needs wasinn[metrics])")
    run.add_argument("--metrics-addr", metavar="ADDR",
                     help=f"the address --metrics-port listens on (default {METRICS_ADDR}: "
                          "this machine only)")
    # Optional here only so that its absence is reported alone (argparse would name ARGS
    # as required too): main() refuses a run without it.
    run.add_argument("guest", metavar="GUEST.wasm", nargs="?")
    run.set_defaults(command_parser=run)
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                     help="arguments passed to the guest")

    infer = sub.add_parser(
        "infer", parents=[common, registry], help="run a registered model or pipeline",
        description="Run a model or pipeline of the registry on inputs from numpy files "
                    "(no guest); with --requests, as a load test.")
    infer.add_argument("name", metavar="NAME",
                       help="a [models] or [pipelines] entry, or a model registered here")
    infer.add_argument("--input", action="append", default=[],
                       metavar="NAME=FILE.npy|FILE.npz",
                       help="an input from a .npy file, or every input of a .npz archive")
    infer.add_argument("--zeros", action="store_true",
                       help="fill the inputs not given with zeros of the model's shapes")
    infer.add_argument("--shape", action="append", default=[], metavar="NAME=D,D,...",
                       help="the shape of a zero-filled input (where the model has none)")
    infer.add_argument("--target", type=_target,
                       help="cpu, gpu or tpu (default: the entry's target)")
    infer.add_argument("--requests", type=int, default=1, metavar="N",
                       help="requests to send (default 1)")
    infer.add_argument("--concurrency", type=int, default=1, metavar="C",
                       help="callers sending them at once, a context each (default 1)")
    infer.add_argument("--timeout", type=float, metavar="SECONDS",
                       help="each request's timeout (default: none)")
    infer.add_argument("--save", metavar="FILE.npz",
                       help="write the last request's outputs to a numpy archive")
    infer.set_defaults(command_parser=infer)

    sub.add_parser("devices", parents=[common, config],
                   help="list the devices and backends found")
    models = sub.add_parser("models", parents=[common, registry],
                            help="list the model registry")
    models.set_defaults(command_parser=models)
    demo = sub.add_parser("demo", parents=[common],
                          help="classify a generated image with the C example guest")
    demo.add_argument("--width", type=_width, default=0.35,
                      help="MobileNetV2-like width multiplier, > 0 and <= 4 (default 0.35)")
    demo.add_argument("--workdir", metavar="DIR",
                      help="where the model and input go (default: wasinn's cache)")
    return parser


def _target(text: str) -> str:
    # --target: an execution target's name, checked before anything starts.
    try:
        return ExecutionTarget.coerce(text).value
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def _seconds(text: str) -> float:
    # --timeout: a finite number of seconds > 0.
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a number of seconds > 0, such as 30 or 0.5")
    return value


def _fuel(text: str) -> int:
    # --fuel: a whole number of fuel units, 1 to 2**64 - 1 (wasmtime's fuel is a u64).
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_FUEL:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a whole number of fuel units from 1 to {MAX_FUEL}, such "
            "as 1000000000")
    return value


def _port(text: str) -> int:
    # --metrics-port: a TCP port, 0 for a free one.
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a TCP port from 0 to 65535 (0: a free one), such as 9100")
    return value


def _width(text: str) -> float:
    # --width: a finite multiplier of MobileNetV2's channel counts.
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number: expected a width multiplier such as 0.35 or 1.0"
        ) from None
    if not 0 < value <= 4:  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"{text}: expected a width multiplier > 0 and <= 4 (MobileNetV2's are 0.35 to 1.4)")
    return value


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
        if spec.strip() in ("nn", "nn=y", "nn=true", "common", "common=y"):
            continue  # wasi-nn and WASI are always on
        given.append((f"--wasi {spec!r}", parse_nn_graph(spec)))
    flags: dict[str, str] = {}
    for flag, preload in given:
        # A second one would silently replace the first for every guest.
        if flags.setdefault(preload.name, flag) != flag:
            raise InvalidArgumentError(
                f"{flag}: the name {preload.name!r} is already given by "
                f"{flags[preload.name]}: expected each name once")
    return [preload for _, preload in given]


def _check_preload(flag: str, preload: Preload) -> None:
    # Here, not when the runtime checks the merged config: its error would name the
    # config file (or the installed default.toml) for what only the command line gave.
    from wasinn.configs.loader import parse_config

    model = {"files": [str(p.absolute()) for p in preload.paths],
             "encoding": preload.encoding.value}
    parse_config({"models": {preload.name: model}}, None, label=flag, backends=())


@contextlib.asynccontextmanager
async def _stopped_by_ctrl_c() -> AsyncIterator[trio.CancelScope]:
    """A scope that Ctrl-C cancels: the guest is stopped and its models released, and
    the command exits with 130. A guest blocked in a host call that its cancellation
    cannot reach (a component's WASI sleep) is given up on by ``run_wasm`` itself
    :data:`~wasinn.host.guest_thread.STOP_GRACE_S` seconds later: its thread is
    abandoned (a daemon thread, which does not hold the process's exit), and the command
    says so and exits. A second Ctrl-C exits at once (status 130)."""
    import trio

    from wasinn.host.guest_thread import STOP_GRACE_S, abandoned_guest_threads

    if threading.current_thread() is not threading.main_thread():
        with trio.CancelScope() as scope:  # (signals reach the main thread only)
            yield scope
        return
    with trio.CancelScope() as scope, trio.open_signal_receiver(signal.SIGINT) as signals:

        async def watch() -> None:
            async for _ in signals:
                if scope.cancel_called:
                    _exit_now("a second Ctrl-C")
                scope.cancel()

        watching = trio.CancelScope()

        async def watch_until_done() -> None:
            with watching:
                await watch()

        # A system task, not a nursery: the guest's own errors (a trap) reach the
        # caller as they are, not in an exception group.
        trio.lowlevel.spawn_system_task(watch_until_done)
        abandoned_before = abandoned_guest_threads()
        try:
            yield scope
        finally:
            watching.cancel()
            if scope.cancel_called and abandoned_guest_threads() > abandoned_before:
                print(f"wasinn: the guest did not stop within {STOP_GRACE_S:g} s of Ctrl-C "
                      "(it is blocked in a host call, such as a component's WASI sleep): "
                      "exiting", file=sys.stderr)


def _exit_now(why: str, status: int = EXIT_INTERRUPTED) -> None:
    print(f"wasinn: {why}: exiting", file=sys.stderr, flush=True)
    os._exit(status)


async def _run(args: argparse.Namespace) -> int:
    from wasinn.host.runner import TRAP_EXIT_STATUS, GuestTrap
    from wasinn.scheduler import Runtime

    dirs = parse_dirs(args.dir)
    env = dict(parse_env(e) for e in args.env)
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
            async with _stopped_by_ctrl_c() as stop:
                code = await rt.run_wasm(args.guest, argv=args.args, dirs=dirs, env=env,
                                         stdin="inherit")
            return EXIT_INTERRUPTED if stop.cancelled_caught else code
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
    from wasinn.infer import (
        Load,
        check_save_path,
        describe_output,
        infer,
        read_inputs,
        save_outputs,
    )
    from wasinn.scheduler import Runtime

    load: Load = args.load
    shapes = args.shapes
    given = read_inputs(args.input)
    if args.save:
        check_save_path(Path(args.save))
    async with Runtime(_registry_config(args)) as rt:
        report = await infer(rt, args.name, given, zeros=args.zeros, shapes=shapes,
                             target=args.target, load=load)
        stats = rt.stats()
    for name, tensor in report.outputs.items():
        print(describe_output(name, tensor))
    if load.requests > 1:
        print(report.describe_load())
        print(report.model.describe())
        for device in stats:
            if device.finished:
                print(device.describe())
    if args.save:
        save_outputs(Path(args.save), report.outputs)
        print(f"outputs written to {args.save}")
    return 0


async def _devices(args: argparse.Namespace) -> int:
    from wasinn.backends.registry import BackendRegistry
    from wasinn.scheduler import Runtime

    config = _load_config(args.config)
    registry = BackendRegistry(config.runtime.backends or ())
    rows: list[tuple[str, ...]] = []
    found: dict[str, list[str]] = {}
    for name in registry.names():
        if not registry.is_installed(name):
            rows.append((name, "not installed", "-", "-"))
            continue
        try:
            backend = registry.get(name)
            devices = [d.name for d in backend.devices()]
        except WasiNNError as exc:
            rows.append((name, "unavailable", "-", exc.message))
            continue
        encodings = ", ".join(sorted(e.value for e in backend.encodings))
        rows.append((name, "installed", ", ".join(devices) or "-", encodings))
        for device in devices:
            found.setdefault(device, []).append(name)
    print(_table(("BACKEND", "STATUS", "DEVICES", "ENCODINGS"), rows))
    print()
    async with Runtime(config) as rt:
        served = [(d.name, d.kind.value, ", ".join(found.get(d.name, [])) or "-")
                  for d in rt.devices]
    print(_table(("DEVICE", "KIND", "BACKENDS"), served))
    return 0


def _models(args: argparse.Namespace) -> int:
    config = _registry_config(args)
    rows: list[tuple[str, ...]] = [
        (name, "model", m.encoding, m.target, _loaded(m), _batching(m), ", ".join(m.files))
        for name, m in config.models.items()
    ]
    rows += [
        (name, "pipeline", "-", p.target, _loaded(p), _batching(p),
         " -> ".join(s.model for s in p.steps))
        for name, p in config.pipelines.items()
    ]
    if not rows:
        where = args.config or "the embedded default config"
        print(f"no models registered in {where}: add a [models] table, or give "
              "--nn-preload / --wasi nn-graph (to run, infer or models)")
        return 0
    print(_table(("NAME", "KIND", "ENCODING", "TARGET", "LOADED", "BATCHING", "FILES / STEPS"),
                 rows))
    return 0


def _loaded(entry: ModelConfig | PipelineConfig) -> str:
    """When the runtime loads a registry entry, and for how long."""
    if entry.warmup:
        return f"at start, {entry.warmup} warm-up run(s)"
    if entry.preload:
        return "at start"
    return "first use, kept" if entry.kept else "first use"


def _batching(entry: ModelConfig | PipelineConfig) -> str:
    """How a registry entry's requests are batched, in a few words."""
    batching = entry.batching
    if batching is None:
        return "-"
    delay = f", waits {batching.max_delay_ms:g} ms" if batching.max_delay_ms else ""
    return f"up to {batching.max_batch}{delay}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in [header, *rows]]
    return "\n".join(lines)


async def _demo(args: argparse.Namespace) -> int:
    from wasinn.host.demo import run_demo

    workdir = Path(args.workdir) if args.workdir else None
    return await run_demo(width=args.width, workdir=workdir)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``wasinn`` console script; returns the exit status."""
    import trio

    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "run" and args.guest is None:
        args.command_parser.error("the following arguments are required: GUEST.wasm")
    _configure_logging(args.verbose)
    try:
        _parse_values(args)
        if args.command == "run":
            return int(trio.run(_run, args))
        if args.command == "infer":
            return int(trio.run(_infer, args))
        if args.command == "devices":
            return int(trio.run(_devices, args))
        if args.command == "models":
            return _models(args)
        return int(trio.run(_demo, args))
    except UsageError as exc:  # with the subcommand's usage line
        getattr(args, "command_parser", parser).error(str(exc))
    except _FAILURES as exc:
        _say(exc)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BaseExceptionGroup as group:
        # What trio's nurseries raise: a Ctrl-C, or the errors of tasks run side by side.
        if group.subgroup(KeyboardInterrupt) is not None:
            return EXIT_INTERRUPTED
        failures, rest = group.split(_FAILURES)
        if failures is None or rest is not None:
            raise
        for failure in _leaves(failures):
            _say(failure)
        return EXIT_ERROR
    return EXIT_ERROR  # pragma: no cover - parser.error exits


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
