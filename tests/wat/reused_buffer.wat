;; One buffer refilled for each input of "sub" (y = a - b, f32 (1, 4)), as a guest written
;; for a host that copies at set_input does: a = 100 is written and set, then b = 1 is
;; written to the same bytes and set. wasinn reads inputs at compute, so both read 1 and
;; the guest exits with y[0] = 0 (a copying host: 99); the host logs a warning. Errors
;; exit with 200 + errno.
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (import "wasi_ephemeral_nn" "load_by_name" (func $load_by_name (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "init_execution_context" (func $init (param i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "set_input" (func $set_input (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "compute" (func $compute (param i32) (result i32)))
  (import "wasi_ephemeral_nn" "get_output" (func $get_output (param i32 i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0x100) "sub")
  ;; dims [1, 4]
  (data (i32.const 0x200) "\01\00\00\00\04\00\00\00")
  ;; two tensor records, both over the 16 bytes at 0x300: dims 0x200 rank 2, f32
  (data (i32.const 0x400) "\00\02\00\00\02\00\00\00\01\00\00\00\00\03\00\00\10\00\00\00")
  (data (i32.const 0x420) "\00\02\00\00\02\00\00\00\01\00\00\00\00\03\00\00\10\00\00\00")
  (func $ok (param i32)
    (if (local.get 0) (then (call $exit (i32.add (i32.const 200) (local.get 0))))))
  (func (export "_start") (local $ctx i32)
    (call $ok (call $load_by_name (i32.const 0x100) (i32.const 3) (i32.const 0x500)))
    (call $ok (call $init (i32.load (i32.const 0x500)) (i32.const 0x504)))
    (local.set $ctx (i32.load (i32.const 0x504)))
    (f32.store (i32.const 0x300) (f32.const 100))
    (call $ok (call $set_input (local.get $ctx) (i32.const 0) (i32.const 0x400)))
    (f32.store (i32.const 0x300) (f32.const 1))
    (call $ok (call $set_input (local.get $ctx) (i32.const 1) (i32.const 0x420)))
    (call $ok (call $compute (local.get $ctx)))
    (call $ok (call $get_output (local.get $ctx) (i32.const 0) (i32.const 0x600) (i32.const 16)
                                (i32.const 0x508)))
    (call $exit (i32.trunc_f32_s (f32.load (i32.const 0x600))))))
