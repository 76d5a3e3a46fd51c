;; A guest that grows its memory between wasi-nn calls, then hands the host a tensor and an
;; output buffer in the new page, on "identity_static" (f32 (1, 4)): the host must see
;; memory as it is at each call, not as it was at the last one. Exits 0 or the check number.
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (import "wasi_ephemeral_nn" "load_by_name" (func $load_by_name (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "init_execution_context" (func $init (param i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "set_input" (func $set_input (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "compute" (func $compute (param i32) (result i32)))
  (import "wasi_ephemeral_nn" "get_output" (func $get_output (param i32 i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0x100) "identity_static")

  (func $expect (param $tag i32) (param $got i32) (param $want i32)
    (if (i32.ne (local.get $got) (local.get $want))
      (then (call $proc_exit (local.get $tag)))))

  (func (export "_start")
    (local $c i32)
    (call $expect (i32.const 1) (call $load_by_name (i32.const 0x100) (i32.const 15) (i32.const 0x500)) (i32.const 0))
    (call $expect (i32.const 2) (call $init (i32.load (i32.const 0x500)) (i32.const 0x504)) (i32.const 0))
    (local.set $c (i32.load (i32.const 0x504)))
    ;; one page more; everything below lives in it (0x10000 and up)
    (call $expect (i32.const 3) (memory.grow (i32.const 1)) (i32.const 1))
    (i32.store (i32.const 0x10200) (i32.const 1))                    ;; dims [1, 4]
    (i32.store (i32.const 0x10204) (i32.const 4))
    (f32.store (i32.const 0x10300) (f32.const 1))                    ;; data 1 2 3 4
    (f32.store (i32.const 0x10304) (f32.const 2))
    (f32.store (i32.const 0x10308) (f32.const 3))
    (f32.store (i32.const 0x1030c) (f32.const 4))
    (i32.store (i32.const 0x10400) (i32.const 0x10200))              ;; the tensor record
    (i32.store (i32.const 0x10404) (i32.const 2))
    (i32.store (i32.const 0x10408) (i32.const 1))                    ;; f32
    (i32.store (i32.const 0x1040c) (i32.const 0x10300))
    (i32.store (i32.const 0x10410) (i32.const 16))
    (call $expect (i32.const 4) (call $set_input (local.get $c) (i32.const 0) (i32.const 0x10400)) (i32.const 0))
    (call $expect (i32.const 5) (call $compute (local.get $c)) (i32.const 0))
    (call $expect (i32.const 6) (call $get_output (local.get $c) (i32.const 0) (i32.const 0x10600) (i32.const 16) (i32.const 0x10508)) (i32.const 0))
    (call $expect (i32.const 7) (i32.load (i32.const 0x10508)) (i32.const 16))
    (call $expect (i32.const 8) (i32.load (i32.const 0x1060c)) (i32.const 0x40800000)) ;; 4.0
    ;; and past the grown end is still refused
    (call $expect (i32.const 9) (call $get_output (local.get $c) (i32.const 0) (i32.const 0x1fff8) (i32.const 16) (i32.const 0x10508)) (i32.const 1))
  )
)
