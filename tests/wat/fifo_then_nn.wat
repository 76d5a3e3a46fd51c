;; Loads the registry model "affine", then opens and reads the file "fifo" of its first
;; preopened directory (fd 3). On a FIFO, wasmtime's path_open blocks in the host until
;; a writer opens it: a host call that no cancellation reaches. (Its fd_read then fails,
;; ESPIPE: wasmtime reads files at an offset. What it returns does not matter here.)
;; Straight on, with no epoch check in between (no loop, no call), it makes two more
;; wasi-nn calls, load_by_name "affine" and init_execution_context on the graph it
;; loaded first, and exits with 10 * the first one's errno + the second one's (0 when
;; both succeed). Exits 100 + errno when the first load fails, 120 when the open does.
(module
  (import "wasi_ephemeral_nn" "load_by_name"
    (func $load_by_name (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "init_execution_context"
    (func $init (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_open"
    (func $path_open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_read"
    (func $read (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (data (i32.const 0x10) "affine")
  (data (i32.const 0x20) "fifo")
  (func (export "_start")
    (local $errno i32)
    (local $late_load i32)
    ;; the graph handle goes to 0x40
    (local.set $errno (call $load_by_name (i32.const 0x10) (i32.const 6) (i32.const 0x40)))
    (if (local.get $errno) (then (call $exit (i32.add (i32.const 100) (local.get $errno)))))
    ;; path_open(fd 3, no symlink following, "fifo", no oflags, rights fd_read, -, no
    ;; fdflags) -> the new fd at 0x44
    (if (call $path_open (i32.const 3) (i32.const 0) (i32.const 0x20) (i32.const 4)
                         (i32.const 0) (i64.const 2) (i64.const 0) (i32.const 0)
                         (i32.const 0x44))
      (then (call $exit (i32.const 120))))
    ;; one iovec at 0x100: 16 bytes at 0x200; the count read goes to 0x300
    (i32.store (i32.const 0x100) (i32.const 0x200))
    (i32.store (i32.const 0x104) (i32.const 16))
    (drop (call $read (i32.load (i32.const 0x44)) (i32.const 0x100) (i32.const 1)
                      (i32.const 0x300)))
    ;; straight on: the two wasi-nn calls
    (local.set $late_load
      (call $load_by_name (i32.const 0x10) (i32.const 6) (i32.const 0x48)))
    (call $exit
      (i32.add (i32.mul (local.get $late_load) (i32.const 10))
               (call $init (i32.load (i32.const 0x40)) (i32.const 0x4c))))))
