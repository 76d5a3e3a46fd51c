;; A guest that exports no memory: wasi-nn calls get missing_memory (3). It cannot call
;; WASI's proc_exit without a memory either, so it returns normally on 3 and traps otherwise.
(module
  (import "wasi_ephemeral_nn" "load_by_name" (func $load_by_name (param i32 i32 i32) (result i32)))
  (memory 1)
  (func (export "_start")
    (if (i32.ne (call $load_by_name (i32.const 0) (i32.const 4) (i32.const 8)) (i32.const 3))
      (then unreachable))))
