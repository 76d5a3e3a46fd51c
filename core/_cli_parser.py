"""The ``wasinn`` command line's grammar: its commands, their options and the form of
each option's value (argparse), checked as it is parsed. What the commands do is
:mod:`wasinn.cli`'s."""

from __future__ import annotations

import argparse
import math

from wasinn._version import __version__
from wasinn.enums import ExecutionTarget
from wasinn.errors import InvalidArgumentError

#: The most fuel ``--fuel`` may give (wasmtime counts fuel in a u64).
MAX_FUEL = 2**64 - 1
#: Where ``--metrics-port`` listens unless ``--metrics-addr`` says: this machine only.
METRICS_ADDR = "127.0.0.1"


def build_parser() -> argparse.ArgumentParser:
    """The ``wasinn`` command line: ``run``, ``infer``, ``devices``, ``models`` and ``demo``,
    each with its options; a value of the wrong form is a usage error (status 2)."""
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
    parser.add_argument("--version", action="version", version=f"wasinn {__version__}",
                        help="print wasinn's version and exit")
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
                       help="an input from a .npy file, or every input of a .npz archive "
                            "(a bf16 input: a file saved from an ml_dtypes.bfloat16 array)")
    infer.add_argument("--zeros", action="store_true",
                       help="fill the inputs not given with zeros of the model's shapes")
    infer.add_argument("--shape", action="append", default=[], metavar="NAME=D,D,...[:TYPE]",
                       help="the shape of a zero-filled input (where the model has none; "
                            "no dimensions, NAME= or NAME=:TYPE, for a scalar), and its "
                            "element type (f16, bf16, f32, f64, u8, i32, i64) where the "
                            "model declares none and f32 will not do, as TorchScript token "
                            "ids: ids=1,8:i64")
    infer.add_argument("--target", type=_target,
                       help="cpu, gpu or tpu (default: the entry's target)")
    infer.add_argument("--requests", type=int, default=1, metavar="N",
                       help="requests to send (default 1)")
    infer.add_argument("--concurrency", type=int, default=1, metavar="C",
                       help="callers sending them at once, a context each (default 1)")
    infer.add_argument("--timeout", type=float, metavar="SECONDS",
                       help="each request's timeout (default: none)")
    infer.add_argument("--save", metavar="FILE.npz",
                       help="write the last request's outputs to a numpy archive, each "
                            "under its name (numpy.load(FILE)[NAME]; a bf16 output as numpy "
                            "stores ml_dtypes.bfloat16: .view(ml_dtypes.bfloat16) reads it)")
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


def _whole(text: str, low: int, high: int, expected: str) -> int:
    # An int from low to high, else an error saying what was expected.
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}")
    return value


def _fuel(text: str) -> int:
    # --fuel: a whole number of fuel units, 1 to 2**64 - 1 (wasmtime's fuel is a u64).
    return _whole(text, 1, MAX_FUEL, f"a whole number of fuel units from 1 to {MAX_FUEL}, "
                  "such as 1000000000")


def _port(text: str) -> int:
    # --metrics-port: a TCP port, 0 for a free one.
    return _whole(text, 0, 65535, "a TCP port from 0 to 65535 (0: a free one), such as 9100")


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
