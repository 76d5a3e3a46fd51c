;; A guest built with the Rust wasi-nn crate <= 0.5 numbers tensor types f16=0 f32=1
;; u8=2 i32=3; this one sends u8 as 2 and i32 as 3 to the identity models "identity_u8"
;; and "identity_i32" (shape (n, 4)). Exits 0 when every check holds, else the check number.
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (import "wasi_ephemeral_nn" "load_by_name" (func $load_by_name (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "init_execution_context" (func $init (param i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "set_input" (func $set_input (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "compute" (func $compute (param i32) (result i32)))
  (import "wasi_ephemeral_nn" "get_output" (func $get_output (param i32 i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0x100) "identity_u8")
  (data (i32.const 0x110) "identity_i32")
  (data (i32.const 0x200) "\01\00\00\00\04\00\00\00")            ;; dims [1, 4]
  (data (i32.const 0x300) "\0a\14\1e\28")                        ;; u8 10 20 30 40
  (data (i32.const 0x320) "\07\00\00\00\08\00\00\00\09\00\00\00\fb\ff\ff\ff") ;; i32 7 8 9 -5
  ;; records: u8 sent as 2 (with padding garbage), i32 sent as 3
  (data (i32.const 0x400) "\00\02\00\00\02\00\00\00\02\10\10\00\00\03\00\00\04\00\00\00")
  (data (i32.const 0x420) "\00\02\00\00\02\00\00\00\03\00\00\00\20\03\00\00\10\00\00\00")

  (func $expect (param $tag i32) (param $got i32) (param $want i32)
    (if (i32.ne (local.get $got) (local.get $want))
      (then (call $proc_exit (local.get $tag)))))

  (func (export "_start")
    (call $expect (i32.const 1) (call $load_by_name (i32.const 0x100) (i32.const 11) (i32.const 0x500)) (i32.const 0))
    (call $expect (i32.const 2) (call $init (i32.load (i32.const 0x500)) (i32.const 0x504)) (i32.const 0))
    (call $expect (i32.const 3) (call $set_input (i32.load (i32.const 0x504)) (i32.const 0) (i32.const 0x400)) (i32.const 0))
    (call $expect (i32.const 4) (call $compute (i32.load (i32.const 0x504))) (i32.const 0))
    (call $expect (i32.const 5) (call $get_output (i32.load (i32.const 0x504)) (i32.const 0) (i32.const 0x600) (i32.const 16) (i32.const 0x508)) (i32.const 0))
    (call $expect (i32.const 6) (i32.load (i32.const 0x508)) (i32.const 4))
    (call $expect (i32.const 7) (i32.load (i32.const 0x600)) (i32.const 0x281e140a))
    (call $expect (i32.const 11) (call $load_by_name (i32.const 0x110) (i32.const 12) (i32.const 0x510)) (i32.const 0))
    (call $expect (i32.const 12) (call $init (i32.load (i32.const 0x510)) (i32.const 0x514)) (i32.const 0))
    (call $expect (i32.const 13) (call $set_input (i32.load (i32.const 0x514)) (i32.const 0) (i32.const 0x420)) (i32.const 0))
    (call $expect (i32.const 14) (call $compute (i32.load (i32.const 0x514))) (i32.const 0))
    (call $expect (i32.const 15) (call $get_output (i32.load (i32.const 0x514)) (i32.const 0) (i32.const 0x640) (i32.const 16) (i32.const 0x518)) (i32.const 0))
    (call $expect (i32.const 16) (i32.load (i32.const 0x518)) (i32.const 16))
    (call $expect (i32.const 17) (i32.load (i32.const 0x64c)) (i32.const -5))
  )
)
