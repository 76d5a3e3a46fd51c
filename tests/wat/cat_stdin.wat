;; Copies its stdin to its stdout, 64 KiB at a time; exits 0, or 125 when a call fails.
(module
  (import "wasi_snapshot_preview1" "fd_read"
    (func $read (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write"
    (func $write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 2)
  (func (export "_start")
    (local $got i32)
    (loop $chunks
      (i32.store (i32.const 0x100) (i32.const 0x10000))
      (i32.store (i32.const 0x104) (i32.const 0x10000))
      (if (call $read (i32.const 0) (i32.const 0x100) (i32.const 1) (i32.const 0x300))
        (then (call $exit (i32.const 125))))
      (local.set $got (i32.load (i32.const 0x300)))
      (if (local.get $got)
        (then
          ;; write it all: the iovec advances past what each write took
          (i32.store (i32.const 0x104) (local.get $got))
          (loop $out
            (if (call $write (i32.const 1) (i32.const 0x100) (i32.const 1) (i32.const 0x304))
              (then (call $exit (i32.const 125))))
            (i32.store (i32.const 0x100)
              (i32.add (i32.load (i32.const 0x100)) (i32.load (i32.const 0x304))))
            (i32.store (i32.const 0x104)
              (i32.sub (i32.load (i32.const 0x104)) (i32.load (i32.const 0x304))))
            (br_if $out (i32.load (i32.const 0x104))))
          (br $chunks))))
    (call $exit (i32.const 0))))
