;; Reads its whole stdin, 64 KiB at a time, and exits with the sum of its bytes
;; modulo 113 (or with 125 when a read fails: WASI exit statuses stop at 125).
(module
  (import "wasi_snapshot_preview1" "fd_read"
    (func $read (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 2)
  (func (export "_start")
    (local $errno i32) (local $got i32) (local $i i32) (local $sum i32)
    (i32.store (i32.const 0x100) (i32.const 0x10000))
    (i32.store (i32.const 0x104) (i32.const 0x10000))
    (loop $chunks
      (local.set $errno
        (call $read (i32.const 0) (i32.const 0x100) (i32.const 1) (i32.const 0x300)))
      (if (local.get $errno)
        (then (call $exit (i32.const 125))))
      (local.set $got (i32.load (i32.const 0x300)))
      (if (local.get $got)
        (then
          (local.set $i (i32.const 0))
          (loop $bytes
            (local.set $sum
              (i32.rem_u
                (i32.add (local.get $sum)
                         (i32.load8_u (i32.add (i32.const 0x10000) (local.get $i))))
                (i32.const 113)))
            (local.set $i (i32.add (local.get $i) (i32.const 1)))
            (br_if $bytes (i32.lt_u (local.get $i) (local.get $got))))
          (br $chunks))))
    (call $exit (local.get $sum))))
