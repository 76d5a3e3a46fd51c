;; Reads up to 16 bytes of its stdin and exits with the number read (0 at end of
;; file), or with 100 + fd_read's errno when the read fails.
(module
  (import "wasi_snapshot_preview1" "fd_read"
    (func $read (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (func (export "_start")
    (local $errno i32)
    (i32.store (i32.const 0x100) (i32.const 0x200))
    (i32.store (i32.const 0x104) (i32.const 16))
    (local.set $errno
      (call $read (i32.const 0) (i32.const 0x100) (i32.const 1) (i32.const 0x300)))
    (if (local.get $errno)
      (then (call $exit (i32.add (i32.const 100) (local.get $errno)))))
    (call $exit (i32.load (i32.const 0x300)))))
