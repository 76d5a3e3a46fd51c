;; An output bound before compute (set_output_by_name) on the model "identity" (y = x,
;; f32 (n, 4): y's size is known only once the run ends) whose buffer turns out too
;; small: compute returns too_large and writes the size this run's output needs to
;; bytes_written, on the context's first compute and after a smaller one succeeded, so a
;; guest that grows its buffer to that size and computes again gets its output. Exits 0
;; or the check number.
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (import "wasi_ephemeral_nn" "load_by_name" (func $load_by_name (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "init_execution_context" (func $init (param i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "set_input" (func $set_input (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "set_output_by_name" (func $set_output_by_name (param i32 i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "compute" (func $compute (param i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0x100) "identity")
  (data (i32.const 0x120) "y")
  (data (i32.const 0x200) "\02\00\00\00\04\00\00\00")  ;; dims [2, 4]
  (data (i32.const 0x210) "\01\00\00\00\04\00\00\00")  ;; dims [1, 4]
  (data (i32.const 0x300)                               ;; 1.0 ... 8.0
    "\00\00\80\3f\00\00\00\40\00\00\40\40\00\00\80\40\00\00\a0\40\00\00\c0\40\00\00\e0\40\00\00\00\41")
  ;; tensor records: f32 [2, 4] (32 bytes) at 0x400, f32 [1, 4] (16 bytes) at 0x420
  (data (i32.const 0x400) "\00\02\00\00\02\00\00\00\01\00\00\00\00\03\00\00\20\00\00\00")
  (data (i32.const 0x420) "\10\02\00\00\02\00\00\00\01\00\00\00\00\03\00\00\10\00\00\00")
  (data (i32.const 0x508) "\ef\be\ad\de")              ;; bytes_written, before any compute
  (data (i32.const 0x600) "\aa\aa\aa\aa")              ;; the bound buffer, before any compute

  (func $expect (param $tag i32) (param $got i32) (param $want i32)
    (if (i32.ne (local.get $got) (local.get $want))
      (then (call $proc_exit (local.get $tag)))))

  (func (export "_start")
    (local $c i32)
    (call $expect (i32.const 1) (call $load_by_name (i32.const 0x100) (i32.const 8) (i32.const 0x500)) (i32.const 0))
    (call $expect (i32.const 2) (call $init (i32.load (i32.const 0x500)) (i32.const 0x504)) (i32.const 0))
    (local.set $c (i32.load (i32.const 0x504)))
    (call $expect (i32.const 3) (call $set_input (local.get $c) (i32.const 0) (i32.const 0x400)) (i32.const 0))
    (call $expect (i32.const 4) (call $set_output_by_name (local.get $c) (i32.const 0x120) (i32.const 1) (i32.const 0x600) (i32.const 16) (i32.const 0x508)) (i32.const 0))
    ;; the first compute: 32 bytes for a 16-byte buffer
    (call $expect (i32.const 5) (call $compute (local.get $c)) (i32.const 7))
    (call $expect (i32.const 6) (i32.load (i32.const 0x508)) (i32.const 32))
    (call $expect (i32.const 7) (i32.load (i32.const 0x600)) (i32.const 0xaaaaaaaa)) ;; untouched
    ;; 16 bytes fit
    (call $expect (i32.const 8) (call $set_input (local.get $c) (i32.const 0) (i32.const 0x420)) (i32.const 0))
    (call $expect (i32.const 9) (call $compute (local.get $c)) (i32.const 0))
    (call $expect (i32.const 10) (i32.load (i32.const 0x508)) (i32.const 16))
    (call $expect (i32.const 11) (i32.load (i32.const 0x60c)) (i32.const 0x40800000)) ;; 4.0
    ;; 32 bytes again: the size written is this run's, not the last success's 16
    (call $expect (i32.const 12) (call $set_input (local.get $c) (i32.const 0) (i32.const 0x400)) (i32.const 0))
    (call $expect (i32.const 13) (call $compute (local.get $c)) (i32.const 7))
    (call $expect (i32.const 14) (i32.load (i32.const 0x508)) (i32.const 32))
    ;; grow the buffer to bytes_written and compute again
    (call $expect (i32.const 15) (call $set_output_by_name (local.get $c) (i32.const 0x120) (i32.const 1) (i32.const 0x600) (i32.load (i32.const 0x508)) (i32.const 0x508)) (i32.const 0))
    (call $expect (i32.const 16) (call $compute (local.get $c)) (i32.const 0))
    (call $expect (i32.const 17) (i32.load (i32.const 0x508)) (i32.const 32))
    (call $expect (i32.const 18) (i32.load (i32.const 0x61c)) (i32.const 0x41000000)) ;; 8.0
  )
)
