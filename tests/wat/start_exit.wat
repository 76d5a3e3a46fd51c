;; Exits with the status 7 from its (start) function: before _start.
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (memory (export "memory") 1)
  (func $init (call $proc_exit (i32.const 7)))
  (start $init)
  (func (export "_start") unreachable))
