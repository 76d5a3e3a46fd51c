;; Core module of the sleeping command (world `sleep` in world.wit), written by hand in
;; WAT; `wasm-tools component embed` + `component new` make it a component.
(module
  (import "wasi:clocks/monotonic-clock@0.2.0" "subscribe-duration"
    (func $subscribe_duration (param i64) (result i32)))
  (import "wasi:io/poll@0.2.0" "[method]pollable.block" (func $block (param i32)))
  (import "wasi:io/poll@0.2.0" "[resource-drop]pollable" (func $drop (param i32)))
  (memory (export "memory") 1)
  (func (export "cabi_realloc") (param i32 i32 i32 i32) (result i32) unreachable)
  (func (export "wasi:cli/run@0.2.0#run") (result i32)
    (local $pollable i32)
    (local.set $pollable (call $subscribe_duration (i64.const 600_000_000_000)))
    (call $block (local.get $pollable))
    (call $drop (local.get $pollable))
    (i32.const 0)))
