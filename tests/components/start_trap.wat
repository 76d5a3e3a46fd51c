;; A WASI 0.2 command component whose core module's start function traps: `wasinn run`
;; reports the trap (exit 134) before `run` is ever called.
(component
  (core module $m
    (func $starting unreachable)
    (start $starting)
    (func (export "run") (result i32) (i32.const 0)))
  (core instance $i (instantiate $m))
  (func $run (result (result)) (canon lift (core func $i "run")))
  (instance $run-instance (export "run" (func $run)))
  (export "wasi:cli/run@0.2.0" (instance $run-instance)))
