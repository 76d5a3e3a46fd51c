;; wasinn's extensions and WasmEdge's streaming calls on the identity model "identity_static"
;; (f32 (1, 4)): a context bound to a target, inputs by name, an output buffer bound before
;; compute (too small, then right), compute_single's end of sequence. Exits 0 or the check number.
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (import "wasi_ephemeral_nn" "load_by_name" (func $load_by_name (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "init_execution_context_on" (func $init_on (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "set_input_by_name" (func $set_input_by_name (param i32 i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "set_output_by_name" (func $set_output_by_name (param i32 i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "compute" (func $compute (param i32) (result i32)))
  (import "wasi_ephemeral_nn" "compute_single" (func $compute_single (param i32) (result i32)))
  (import "wasi_ephemeral_nn" "get_output_single" (func $get_output_single (param i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "fini_single" (func $fini_single (param i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0x100) "identity_static")
  (data (i32.const 0x120) "x")
  (data (i32.const 0x124) "y")
  (data (i32.const 0x200) "\01\00\00\00\04\00\00\00")
  (data (i32.const 0x300) "\00\00\80\3f\00\00\00\40\00\00\40\40\00\00\80\40") ;; 1.0 2.0 3.0 4.0
  (data (i32.const 0x400) "\00\02\00\00\02\00\00\00\01\00\00\00\00\03\00\00\10\00\00\00")

  (func $expect (param $tag i32) (param $got i32) (param $want i32)
    (if (i32.ne (local.get $got) (local.get $want))
      (then (call $proc_exit (local.get $tag)))))

  (func (export "_start")
    (local $c i32)
    (call $expect (i32.const 1) (call $load_by_name (i32.const 0x100) (i32.const 15) (i32.const 0x500)) (i32.const 0))
    (call $expect (i32.const 2) (call $init_on (i32.load (i32.const 0x500)) (i32.const 7) (i32.const 0x504)) (i32.const 1)) ;; unknown target
    (call $expect (i32.const 3) (call $init_on (i32.load (i32.const 0x500)) (i32.const 0) (i32.const 0x504)) (i32.const 0))
    (local.set $c (i32.load (i32.const 0x504)))
    (call $expect (i32.const 4) (call $set_input_by_name (local.get $c) (i32.const 0x120) (i32.const 1) (i32.const 0x400)) (i32.const 0))
    ;; a bound buffer too small: compute says too_large and writes the needed size
    (call $expect (i32.const 5) (call $set_output_by_name (local.get $c) (i32.const 0x124) (i32.const 1) (i32.const 0x600) (i32.const 8) (i32.const 0x508)) (i32.const 0))
    (call $expect (i32.const 6) (call $compute (local.get $c)) (i32.const 7))
    (call $expect (i32.const 7) (i32.load (i32.const 0x508)) (i32.const 16))
    (call $expect (i32.const 8) (call $set_output_by_name (local.get $c) (i32.const 0x124) (i32.const 1) (i32.const 0x600) (i32.const 16) (i32.const 0x508)) (i32.const 0))
    (call $expect (i32.const 9) (call $set_output_by_name (local.get $c) (i32.const 0x120) (i32.const 1) (i32.const 0x600) (i32.const 16) (i32.const 0x508)) (i32.const 8)) ;; "x" is no output
    (call $expect (i32.const 10) (call $set_output_by_name (local.get $c) (i32.const 0x124) (i32.const 1) (i32.const 0xfffffff8) (i32.const 16) (i32.const 0x508)) (i32.const 1))
    (i32.store (i32.const 0x508) (i32.const 0))
    (call $expect (i32.const 11) (call $compute (local.get $c)) (i32.const 0))
    (call $expect (i32.const 12) (i32.load (i32.const 0x508)) (i32.const 16))
    (call $expect (i32.const 13) (i32.load (i32.const 0x60c)) (i32.const 0x40800000)) ;; 4.0 written in place
    ;; the input is read at compute time, from where set_input_by_name pointed
    (f32.store (i32.const 0x30c) (f32.const 9))
    (call $expect (i32.const 14) (call $compute (local.get $c)) (i32.const 0))
    (call $expect (i32.const 15) (i32.load (i32.const 0x60c)) (i32.const 0x41100000)) ;; 9.0
    ;; streaming: one result, then end_of_sequence until new input or fini_single
    (call $expect (i32.const 20) (call $compute_single (local.get $c)) (i32.const 0))
    (call $expect (i32.const 21) (call $get_output_single (local.get $c) (i32.const 0) (i32.const 0x700) (i32.const 16) (i32.const 0x50c)) (i32.const 0))
    (call $expect (i32.const 22) (i32.load (i32.const 0x50c)) (i32.const 16))
    (call $expect (i32.const 23) (call $compute_single (local.get $c)) (i32.const 100))
    (call $expect (i32.const 24) (call $fini_single (local.get $c)) (i32.const 0))
    (call $expect (i32.const 25) (call $compute_single (local.get $c)) (i32.const 0))
    (call $expect (i32.const 26) (call $fini_single (i32.const 99)) (i32.const 8))
  )
)
