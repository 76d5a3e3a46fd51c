"""wasmtime-py / Wasmtime C API: no way to set the hostcall fuel, so a component cannot pass
a host function a list<u8> of more than 2,796,202 bytes.

Uses only wasmtime. A hand-written component imports ``take: func(data: list<u8>) -> u32``
(the host returns the length it got) and exports ``run: func(n: u32) -> u32``, which calls
``take`` with the first n bytes of its memory. Rust embedders raise the limit with
``Store::set_hostcall_fuel``; the script then lists the names with "fuel" in wasmtime-py
and the C API names with "fuel" or "hostcall" in the shared library it loads.
Usage: python wasmtime_hostcall_fuel.py
"""

import importlib.metadata
import re
import time
from pathlib import Path

import wasmtime
from wasmtime import Config, Engine, Store
from wasmtime.component import Component, Linker

COMPONENT = r"""(component
  (import "take" (func $take (param "data" (list u8)) (result u32)))
  (core module $Mem (memory (export "memory") 64))  ;; 4 MiB
  (core instance $mem (instantiate $Mem))
  (alias core export $mem "memory" (core memory $memory))
  (core func $take_lowered (canon lower (func $take) (memory $memory)))
  (core module $Main
    (import "host" "take" (func $take (param i32 i32) (result i32)))
    (func (export "run") (param $n i32) (result i32)
      (call $take (i32.const 0) (local.get $n))))
  (core instance $main (instantiate $Main
    (with "host" (instance (export "take" (func $take_lowered))))))
  (func (export "run") (param "n" u32) (result u32) (canon lift (core func $main "run")))
)"""


def call_with(engine: Engine, component: Component, n: int, fuel: int | None = None) -> str:
    store = Store(engine)
    if fuel is not None:
        store.set_fuel(fuel)  # the ordinary (instruction) fuel
    linker = Linker(engine)
    with linker.root() as root:
        root.add_func("take", lambda _store, data: len(data))
    instance = linker.instantiate(store, component)
    run = instance.get_func(store, "run")
    assert run is not None
    start = time.perf_counter()
    try:
        got = run(store, n)
    except wasmtime.WasmtimeError as exc:
        last = str(exc).strip().splitlines()[-1].strip()
        return f"trapped: {last}"
    return f"host got {got:,} bytes ({time.perf_counter() - start:.1f} s)"


def main() -> None:
    print("wasmtime-py", importlib.metadata.version("wasmtime"))
    engine = Engine()
    component = Component(engine, COMPONENT)
    for n in (1_000, 2_796_202, 2_796_203, 3 * 2**20):
        print(f"list<u8> of {n:>9,} bytes: {call_with(engine, component, n)}", flush=True)
    config = Config()
    config.consume_fuel = True
    fueled = Engine(config)
    print(f"list<u8> of {3 * 2**20:>9,} bytes, Config.consume_fuel and Store.set_fuel(2**62): "
          f"{call_with(fueled, Component(fueled, COMPONENT), 3 * 2**20, fuel=2**62)}")

    names = [name for module in (wasmtime, wasmtime.component)
             for name in dir(module) if "fuel" in name.lower()]
    store_api = [name for name in dir(Store) if "fuel" in name.lower()]
    print("wasmtime-py names with 'fuel' (modules):", names or "none")
    print("wasmtime.Store methods with 'fuel':", store_api)
    library = Path(wasmtime._ffi.filename)  # the libwasmtime that wasmtime-py loaded
    names = {m.decode() for m in re.findall(rb"wasmtime_\w*(?:fuel|hostcall)\w*",
                                            library.read_bytes())}
    exported = sorted(name for name in names if _exported(name))
    print(f"exported C API functions with 'fuel' or 'hostcall' in {library.name}:", exported)


def _exported(symbol: str) -> bool:
    try:
        getattr(wasmtime._ffi.dll, symbol)
    except AttributeError:
        return False
    return True


if __name__ == "__main__":
    main()
