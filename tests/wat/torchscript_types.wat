;; A TorchScript model "add_one_ts" (x + 1) declares no element types: set_input takes
;; i64, u8 and f32 tensors alike and each run's output has its input's type (before, every
;; type but the f32 placeholder got invalid_argument at set_input). A byte buffer bound
;; to its output (set_output_by_name) receives an i64 result. Exits 0 or the check number.
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (import "wasi_ephemeral_nn" "load_by_name" (func $load_by_name (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "init_execution_context" (func $init (param i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "set_input" (func $set_input (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "set_output_by_name" (func $set_output_by_name (param i32 i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "compute" (func $compute (param i32) (result i32)))
  (import "wasi_ephemeral_nn" "get_output" (func $get_output (param i32 i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0x000) "add_one_ts")
  (data (i32.const 0x020) "output")
  (data (i32.const 0x040) "\01\00\00\00\04\00\00\00")  ;; dims [1, 4]
  (data (i32.const 0x100)                               ;; i64 1, 2, 3, 4
    "\01\00\00\00\00\00\00\00\02\00\00\00\00\00\00\00\03\00\00\00\00\00\00\00\04\00\00\00\00\00\00\00")
  (data (i32.const 0x140) "\01\02\03\04")              ;; u8 1, 2, 3, 4
  (data (i32.const 0x150)                               ;; f32 1.0, 2.0, 3.0, 4.0
    "\00\00\80\3f\00\00\00\40\00\00\40\40\00\00\80\40")
  ;; tensor records (dims, rank, type, data, bytes): i64 at 0x200, u8 at 0x220, f32 at 0x240
  (data (i32.const 0x200) "\40\00\00\00\02\00\00\00\05\00\00\00\00\01\00\00\20\00\00\00")
  (data (i32.const 0x220) "\40\00\00\00\02\00\00\00\03\00\00\00\40\01\00\00\04\00\00\00")
  (data (i32.const 0x240) "\40\00\00\00\02\00\00\00\01\00\00\00\50\01\00\00\10\00\00\00")

  (func $expect (param $tag i32) (param $got i32) (param $want i32)
    (if (i32.ne (local.get $got) (local.get $want))
      (then (call $proc_exit (local.get $tag)))))

  ;; set_input(record), compute, get_output into 0x400 (64 bytes): checks from $tag on
  (func $run (param $c i32) (param $record i32) (param $tag i32)
    (call $expect (local.get $tag) (call $set_input (local.get $c) (i32.const 0) (local.get $record)) (i32.const 0))
    (call $expect (i32.add (local.get $tag) (i32.const 1)) (call $compute (local.get $c)) (i32.const 0))
    (call $expect (i32.add (local.get $tag) (i32.const 2))
      (call $get_output (local.get $c) (i32.const 0) (i32.const 0x400) (i32.const 64) (i32.const 0x308)) (i32.const 0)))

  (func (export "_start")
    (local $c i32)
    (call $expect (i32.const 1) (call $load_by_name (i32.const 0x000) (i32.const 10) (i32.const 0x300)) (i32.const 0))
    (call $expect (i32.const 2) (call $init (i32.load (i32.const 0x300)) (i32.const 0x304)) (i32.const 0))
    (local.set $c (i32.load (i32.const 0x304)))
    ;; i64 in, i64 out: 2, 3, 4, 5
    (call $run (local.get $c) (i32.const 0x200) (i32.const 10))
    (call $expect (i32.const 13) (i32.load (i32.const 0x308)) (i32.const 32))
    (call $expect (i32.const 14) (i32.load (i32.const 0x400)) (i32.const 2))
    (call $expect (i32.const 15) (i32.load (i32.const 0x404)) (i32.const 0))
    (call $expect (i32.const 16) (i32.load (i32.const 0x418)) (i32.const 5))
    ;; u8 in, u8 out
    (call $run (local.get $c) (i32.const 0x220) (i32.const 20))
    (call $expect (i32.const 23) (i32.load (i32.const 0x308)) (i32.const 4))
    (call $expect (i32.const 24) (i32.load (i32.const 0x400)) (i32.const 0x05040302))
    ;; f32 in, f32 out
    (call $run (local.get $c) (i32.const 0x240) (i32.const 30))
    (call $expect (i32.const 33) (i32.load (i32.const 0x308)) (i32.const 16))
    (call $expect (i32.const 34) (i32.load (i32.const 0x40c)) (i32.const 0x40a00000)) ;; 5.0
    ;; i64 again, into a bound byte buffer at 0x500
    (call $expect (i32.const 40) (call $set_input (local.get $c) (i32.const 0) (i32.const 0x200)) (i32.const 0))
    (call $expect (i32.const 41) (call $set_output_by_name (local.get $c) (i32.const 0x020) (i32.const 6) (i32.const 0x500) (i32.const 32) (i32.const 0x308)) (i32.const 0))
    (call $expect (i32.const 42) (call $compute (local.get $c)) (i32.const 0))
    (call $expect (i32.const 43) (i32.load (i32.const 0x308)) (i32.const 32))
    (call $expect (i32.const 44) (i32.load (i32.const 0x518)) (i32.const 5))
  )
)
