;; Reads up to 16 bytes of its stdin and exits with fd_read's errno.
(module
  (import "wasi_snapshot_preview1" "fd_read"
    (func $read (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (func (export "_start")
    (i32.store (i32.const 0x100) (i32.const 0x200))
    (i32.store (i32.const 0x104) (i32.const 16))
    (call $exit (call $read (i32.const 0) (i32.const 0x100) (i32.const 1) (i32.const 0x300)))))
