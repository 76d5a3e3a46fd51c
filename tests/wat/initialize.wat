;; Exports _initialize, which sets a global to 5 (a guest's constructors, which may load
;; its graphs), and _start, which exits with that global: 5 when _initialize ran first.
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (memory (export "memory") 1)
  (global $ready (mut i32) (i32.const 0))
  (func (export "_initialize") (global.set $ready (i32.const 5)))
  (func (export "_start") (call $proc_exit (global.get $ready))))
