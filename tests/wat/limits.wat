;; Run with GuestLimits(max_graphs=1, max_contexts=1, max_model_bytes=10,
;; max_tensor_bytes=8): each limit gives too_large (7) and nothing else breaks.
;; Exits 0 when every check holds, else the check number.
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (import "wasi_ephemeral_nn" "load" (func $load (param i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "load_by_name" (func $load_by_name (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "init_execution_context" (func $init (param i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "set_input" (func $set_input (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "finalize_execution_context" (func $finalize (param i32) (result i32)))
  (import "wasi_ephemeral_nn" "unload" (func $unload (param i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0x100) "identity")
  (data (i32.const 0x200) "\01\00\00\00\04\00\00\00")
  (data (i32.const 0x400) "\00\02\00\00\02\00\00\00\01\00\00\00\00\03\00\00\10\00\00\00")
  (data (i32.const 0x700) "\00\08\00\00\12\00\00\00")  ;; one builder: 18 bytes at 0x800
  (data (i32.const 0x800) "eighteen bytes....")

  (func $expect (param $tag i32) (param $got i32) (param $want i32)
    (if (i32.ne (local.get $got) (local.get $want))
      (then (call $proc_exit (local.get $tag)))))

  (func (export "_start")
    (call $expect (i32.const 1) (call $load (i32.const 0x700) (i32.const 1) (i32.const 1) (i32.const 0) (i32.const 0x500)) (i32.const 7)) ;; 18 > 10 model bytes
    (call $expect (i32.const 2) (call $load_by_name (i32.const 0x100) (i32.const 8) (i32.const 0x500)) (i32.const 0))
    (call $expect (i32.const 3) (call $load_by_name (i32.const 0x100) (i32.const 8) (i32.const 0x510)) (i32.const 7)) ;; second graph
    (call $expect (i32.const 4) (call $init (i32.load (i32.const 0x500)) (i32.const 0x504)) (i32.const 0))
    (call $expect (i32.const 5) (call $init (i32.load (i32.const 0x500)) (i32.const 0x514)) (i32.const 7)) ;; second context
    (call $expect (i32.const 6) (call $set_input (i32.load (i32.const 0x504)) (i32.const 0) (i32.const 0x400)) (i32.const 7)) ;; 16 > 8 bytes
    (call $expect (i32.const 7) (call $finalize (i32.load (i32.const 0x504))) (i32.const 0))
    (call $expect (i32.const 8) (call $init (i32.load (i32.const 0x500)) (i32.const 0x514)) (i32.const 0)) ;; room again
    (call $expect (i32.const 9) (call $unload (i32.load (i32.const 0x500))) (i32.const 0))
    (call $expect (i32.const 10) (call $load_by_name (i32.const 0x100) (i32.const 8) (i32.const 0x510)) (i32.const 0)) ;; room again
  )
)
