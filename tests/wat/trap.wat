;; Traps with `unreachable` inside a named function.
(module
  (memory (export "memory") 1)
  (func $explode unreachable)
  (func (export "_start") (call $explode)))
