;; Counts down from 1000 to 0 without calling the host, then returns (exit status 0):
;; a fixed amount of wasm, so a fuel bound either lets it finish or stops it.
(module
  (memory (export "memory") 1)
  (func (export "_start")
    (local $n i32)
    (local.set $n (i32.const 1000))
    (loop $down
      (local.set $n (i32.sub (local.get $n) (i32.const 1)))
      (br_if $down (local.get $n)))))
