;; Loads a model by name in its (start) function, then traps there: before _start.
(module
  (import "wasi_ephemeral_nn" "load_by_name" (func $load_by_name (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0) "identity")
  (func $init
    (drop (call $load_by_name (i32.const 0) (i32.const 8) (i32.const 16)))
    unreachable)
  (start $init)
  (func (export "_start")))
