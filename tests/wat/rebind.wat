;; set_input with the same tensor record again, as an inference loop does, on the dynamic
;; identity model "identity" (f32 (n, 4)): the host may skip re-checking an unchanged
;; record, but must see new data, dimensions changed in place behind the same record, and
;; a new record. Exits 0 or the check number.
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (import "wasi_ephemeral_nn" "load_by_name" (func $load_by_name (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "init_execution_context" (func $init (param i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "set_input" (func $set_input (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "compute" (func $compute (param i32) (result i32)))
  (import "wasi_ephemeral_nn" "get_output" (func $get_output (param i32 i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0x100) "identity")
  (data (i32.const 0x200) "\01\00\00\00\04\00\00\00")                                      ;; dims [1, 4]
  (data (i32.const 0x300) "\00\00\80\3f\00\00\00\40\00\00\40\40\00\00\80\40")               ;; 1.0 2.0 3.0 4.0
  (data (i32.const 0x400) "\00\02\00\00\02\00\00\00\01\00\00\00\00\03\00\00\10\00\00\00")   ;; f32 [1, 4] at 0x300

  (func $expect (param $tag i32) (param $got i32) (param $want i32)
    (if (i32.ne (local.get $got) (local.get $want))
      (then (call $proc_exit (local.get $tag)))))

  (func $run (param $c i32) (param $tag i32) (param $written i32)
    (call $expect (local.get $tag) (call $compute (local.get $c)) (i32.const 0))
    (call $expect (i32.add (local.get $tag) (i32.const 1))
      (call $get_output (local.get $c) (i32.const 0) (i32.const 0x600) (i32.const 64) (i32.const 0x508)) (i32.const 0))
    (call $expect (i32.add (local.get $tag) (i32.const 2)) (i32.load (i32.const 0x508)) (local.get $written)))

  (func (export "_start")
    (local $c i32)
    (call $expect (i32.const 1) (call $load_by_name (i32.const 0x100) (i32.const 8) (i32.const 0x500)) (i32.const 0))
    (call $expect (i32.const 2) (call $init (i32.load (i32.const 0x500)) (i32.const 0x504)) (i32.const 0))
    (local.set $c (i32.load (i32.const 0x504)))
    (call $expect (i32.const 3) (call $set_input (local.get $c) (i32.const 0) (i32.const 0x400)) (i32.const 0))
    (call $run (local.get $c) (i32.const 4) (i32.const 16))
    (call $expect (i32.const 7) (i32.load (i32.const 0x600)) (i32.const 0x3f800000))       ;; 1.0
    ;; the same record again, new data: the new data is computed on
    (f32.store (i32.const 0x300) (f32.const 9))
    (call $expect (i32.const 10) (call $set_input (local.get $c) (i32.const 0) (i32.const 0x400)) (i32.const 0))
    (call $run (local.get $c) (i32.const 11) (i32.const 16))
    (call $expect (i32.const 14) (i32.load (i32.const 0x600)) (i32.const 0x41100000))      ;; 9.0
    ;; the same record, its dimensions changed in place to [2, 4]: 16 bytes no longer fit
    (i32.store (i32.const 0x200) (i32.const 2))
    (call $expect (i32.const 20) (call $set_input (local.get $c) (i32.const 0) (i32.const 0x400)) (i32.const 1))
    ;; ... and with its data length changed to match, it is accepted: 32 bytes come out
    (i32.store (i32.const 0x410) (i32.const 32))
    (call $expect (i32.const 21) (call $set_input (local.get $c) (i32.const 0) (i32.const 0x400)) (i32.const 0))
    (call $run (local.get $c) (i32.const 22) (i32.const 32))
    ;; a record whose type no longer matches the model (u8) is refused again
    (i32.store8 (i32.const 0x408) (i32.const 3))
    (i32.store (i32.const 0x410) (i32.const 8))
    (call $expect (i32.const 30) (call $set_input (local.get $c) (i32.const 0) (i32.const 0x400)) (i32.const 1))
  )
)
