;; Core module of the stdin-reading command (world `read-stdin` in world.wit), written by
;; hand in WAT; `wasm-tools component embed` + `component new` make it a component.
;;
;; result<list<u8>, stream-error> -> retptr: [disc u8 @0][ptr i32 @4][len i32 @8], or on
;; error [disc u8 @0][stream-error disc u8 @4][own<error> i32 @8].
(module
  (import "wasi:cli/stdin@0.2.0" "get-stdin" (func $get_stdin (result i32)))
  (import "wasi:io/streams@0.2.0" "[method]input-stream.blocking-read"
    (func $blocking_read (param i32 i64 i32)))
  (import "wasi:io/streams@0.2.0" "[resource-drop]input-stream"
    (func $drop_stream (param i32)))
  (import "wasi:io/error@0.2.0" "[resource-drop]error" (func $drop_error (param i32)))

  (memory (export "memory") 1)
  (global $bump (mut i32) (i32.const 1024))

  (func (export "cabi_realloc") (param i32 i32 i32 i32) (result i32)
    (local $p i32)
    (local.set $p (global.get $bump))
    (global.set $bump (i32.add (global.get $bump) (local.get 3)))
    (if (i32.gt_u (global.get $bump) (i32.const 65536)) (then unreachable))
    (local.get $p))

  ;; run: func() -> result  (0: ok, 1: error)
  (func (export "wasi:cli/run@0.2.0#run") (result i32)
    (local $stdin i32) (local $failed i32)
    (local.set $stdin (call $get_stdin))
    (call $blocking_read (local.get $stdin) (i64.const 16) (i32.const 16))
    (local.set $failed (i32.load8_u (i32.const 16)))
    (if (i32.and (local.get $failed) (i32.eqz (i32.load8_u (i32.const 20))))
      (then (call $drop_error (i32.load (i32.const 24)))))  ;; last-operation-failed
    (call $drop_stream (local.get $stdin))
    (local.get $failed)))
