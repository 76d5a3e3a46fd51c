;; Loops forever without calling the host: only epoch interruption can stop it.
(module
  (memory (export "memory") 1)
  (func (export "_start") (loop $forever (br $forever))))
