;; A hand-written component (component text format) that runs inference in a loop on an
;; image held in its own memory, for benchmarks/guest_component.py: the guest's work per
;; inference is tensor constructor + compute + data(), exactly what a real guest does.
;; Exports:
;;   fill(data: list<u8>) -> u32     keep `data` (the image, < 8 MiB) in guest memory
;;   prepare(name: string) -> u32    load-by-name + init-execution-context; 0, or 1 + error code
;;   infer(n: u32, words: bool, dims: list<u32>) -> u32
;;       n times: a tensor of the image (FP32, `dims`), compute with it as "input", read the
;;       first output into guest memory (data(), or with `words` the wasinn:nn/bulk calls
;;       tensor-from-words / tensor-words), drop the outputs. Returns the bytes read last
;;       time, or 0xffffffff if a compute failed. At most 64 dimensions.
;;   release()                       drop the context and the graph
(component
  (import "wasi:nn/errors@0.2.0-rc-2024-10-28" (instance $errors
    (export "error" (type $error (sub resource)))
    (type $code (enum "invalid-argument" "invalid-encoding" "timeout" "runtime-error"
                      "unsupported-operation" "too-large" "not-found" "security" "unknown"))
    (export "error-code" (type $code-e (eq $code)))
    (export "[method]error.code" (func (param "self" (borrow $error)) (result $code-e)))
  ))
  (alias export $errors "error" (type $error))
  (import "wasi:nn/tensor@0.2.0-rc-2024-10-28" (instance $tensor
    (export "tensor" (type $tensor (sub resource)))
    (type $dims (list u32))
    (export "tensor-dimensions" (type $dims-e (eq $dims)))
    (type $ty (enum "FP16" "FP32" "FP64" "BF16" "U8" "I32" "I64"))
    (export "tensor-type" (type $ty-e (eq $ty)))
    (type $data (list u8))
    (export "tensor-data" (type $data-e (eq $data)))
    (export "[constructor]tensor"
      (func (param "dimensions" $dims-e) (param "ty" $ty-e) (param "data" $data-e) (result (own $tensor))))
    (export "[method]tensor.data" (func (param "self" (borrow $tensor)) (result $data-e)))
  ))
  (alias export $tensor "tensor" (type $tensor-t))
  (alias export $tensor "tensor-dimensions" (type $dims-t))
  (alias export $tensor "tensor-type" (type $ty-t))
  (import "wasi:nn/inference@0.2.0-rc-2024-10-28" (instance $inference
    (export "graph-execution-context" (type $ctx (sub resource)))
    (alias outer 1 $tensor-t (type $t-outer))
    (export "tensor" (type $t (eq $t-outer)))
    (type $named (tuple string (own $t)))
    (export "named-tensor" (type $named-e (eq $named)))
    (alias outer 1 $error (type $e-outer))
    (export "error" (type $e (eq $e-outer)))
    (export "[method]graph-execution-context.compute"
      (func (param "self" (borrow $ctx)) (param "inputs" (list $named-e))
            (result (result (list $named-e) (error (own $e))))))
  ))
  (alias export $inference "graph-execution-context" (type $ctx-t))
  (import "wasi:nn/graph@0.2.0-rc-2024-10-28" (instance $graph
    (export "graph" (type $graph (sub resource)))
    (alias outer 1 $error (type $e-outer))
    (export "error" (type $e (eq $e-outer)))
    (alias outer 1 $ctx-t (type $c-outer))
    (export "graph-execution-context" (type $c (eq $c-outer)))
    (export "[method]graph.init-execution-context"
      (func (param "self" (borrow $graph)) (result (result (own $c) (error (own $e))))))
    (export "load-by-name"
      (func (param "name" string) (result (result (own $graph) (error (own $e))))))
  ))
  (alias export $graph "graph" (type $graph-t))
  (import "wasinn:nn/bulk@0.1.0" (instance $bulk
    (alias outer 1 $tensor-t (type $t-outer))
    (export "tensor" (type $t (eq $t-outer)))
    (alias outer 1 $dims-t (type $d-outer))
    (export "tensor-dimensions" (type $d (eq $d-outer)))
    (alias outer 1 $ty-t (type $ty-outer))
    (export "tensor-type" (type $ty (eq $ty-outer)))
    (alias outer 1 $error (type $e-outer))
    (export "error" (type $e (eq $e-outer)))
    (export "tensor-from-words"
      (func (param "dimensions" $d) (param "ty" $ty) (param "words" (list u64))
            (result (result (own $t) (error (own $e))))))
    (export "tensor-words" (func (param "tensor" (borrow $t)) (result (list u64))))
  ))

  ;; memory: [0, 1 KiB) return areas and constants; [64 KiB, 8 MiB) the image;
  ;; from 8 MiB a bump heap that every inference empties again.
  (core module $Mem
    (memory (export "memory") 160)
    (global $bump (mut i32) (i32.const 8388608))
    (func (export "realloc") (param $old i32) (param $old_size i32) (param $align i32)
          (param $size i32) (result i32)
      (local $p i32) (local $end i32) (local $have i32)
      (local.set $p (i32.and (i32.add (global.get $bump) (i32.sub (local.get $align) (i32.const 1)))
                             (i32.sub (i32.const 0) (local.get $align))))
      (local.set $end (i32.add (local.get $p) (local.get $size)))
      (local.set $have (i32.shl (memory.size) (i32.const 16)))
      (if (i32.gt_u (local.get $end) (local.get $have))
        (then
          (if (i32.eq (memory.grow (i32.add (i32.shr_u (i32.sub (local.get $end) (local.get $have))
                                                       (i32.const 16)) (i32.const 1)))
                      (i32.const -1))
            (then unreachable))))
      (global.set $bump (local.get $end))
      (local.get $p))
    (func (export "reset") (global.set $bump (i32.const 8388608)))
    (func (export "reset1") (param i32) (global.set $bump (i32.const 8388608)))
  )
  (core instance $mem (instantiate $Mem))
  (alias core export $mem "memory" (core memory $memory))
  (alias core export $mem "realloc" (core func $realloc))
  (alias core export $mem "reset1" (core func $reset1))

  (core func $error.code (canon lower (func $errors "[method]error.code")))
  (core func $error.drop (canon resource.drop $error))
  (core func $tensor.new (canon lower (func $tensor "[constructor]tensor") (memory $memory)))
  (core func $tensor.data (canon lower (func $tensor "[method]tensor.data") (memory $memory) (realloc $realloc)))
  (core func $tensor.drop (canon resource.drop $tensor-t))
  (core func $ctx.compute (canon lower (func $inference "[method]graph-execution-context.compute")
                                 (memory $memory) (realloc $realloc)))
  (core func $ctx.drop (canon resource.drop $ctx-t))
  (core func $graph.init (canon lower (func $graph "[method]graph.init-execution-context") (memory $memory)))
  (core func $graph.load-by-name (canon lower (func $graph "load-by-name") (memory $memory)))
  (core func $graph.drop (canon resource.drop $graph-t))
  (core func $bulk.from-words (canon lower (func $bulk "tensor-from-words") (memory $memory)))
  (core func $bulk.words (canon lower (func $bulk "tensor-words") (memory $memory) (realloc $realloc)))

  (core module $Main
    (import "nn" "error.code" (func $error.code (param i32) (result i32)))
    (import "nn" "error.drop" (func $error.drop (param i32)))
    (import "nn" "tensor.new" (func $tensor.new (param i32 i32 i32 i32 i32) (result i32)))
    (import "nn" "tensor.data" (func $tensor.data (param i32 i32)))
    (import "nn" "tensor.drop" (func $tensor.drop (param i32)))
    (import "nn" "ctx.compute" (func $ctx.compute (param i32 i32 i32 i32)))
    (import "nn" "ctx.drop" (func $ctx.drop (param i32)))
    (import "nn" "graph.init" (func $graph.init (param i32 i32)))
    (import "nn" "graph.load-by-name" (func $graph.load-by-name (param i32 i32 i32)))
    (import "nn" "graph.drop" (func $graph.drop (param i32)))
    (import "nn" "bulk.from-words" (func $bulk.from-words (param i32 i32 i32 i32 i32 i32)))
    (import "nn" "bulk.words" (func $bulk.words (param i32 i32)))
    (import "mem" "memory" (memory 1))
    (import "mem" "reset" (func $reset))
    (data (i32.const 512) "input")
    (global $image i32 (i32.const 65536))
    (global $image_len (mut i32) (i32.const 0))
    (global $graph (mut i32) (i32.const 0))
    (global $ctx (mut i32) (i32.const 0))

    (func (export "fill") (param $ptr i32) (param $len i32) (result i32)
      (memory.copy (global.get $image) (local.get $ptr) (local.get $len))
      (global.set $image_len (local.get $len))
      (call $reset)
      (local.get $len))

    (func $error (param $e i32) (result i32)
      (local $code i32)
      (local.set $code (call $error.code (local.get $e)))
      (call $error.drop (local.get $e))
      (i32.add (local.get $code) (i32.const 1)))

    (func (export "prepare") (param $name i32) (param $len i32) (result i32)
      (call $graph.load-by-name (local.get $name) (local.get $len) (i32.const 0))
      (if (i32.load8_u (i32.const 0)) (then (return (call $error (i32.load (i32.const 4))))))
      (global.set $graph (i32.load (i32.const 4)))
      (call $graph.init (global.get $graph) (i32.const 0))
      (if (i32.load8_u (i32.const 0)) (then (return (call $error (i32.load (i32.const 4))))))
      (global.set $ctx (i32.load (i32.const 4)))
      (call $reset)
      (i32.const 0))

    (func (export "infer") (param $n i32) (param $words i32) (param $dims i32) (param $rank i32)
          (result i32)
      (local $i i32) (local $t i32) (local $outs i32) (local $count i32) (local $j i32)
      (local $read i32)
      ;; the heap is emptied after every inference: keep the dimensions in static memory
      (memory.copy (i32.const 256) (local.get $dims) (i32.shl (local.get $rank) (i32.const 2)))
      (local.set $dims (i32.const 256))
      (block $done
        (loop $next
          (br_if $done (i32.ge_u (local.get $i) (local.get $n)))
          (if (local.get $words)
            (then
              (call $bulk.from-words (local.get $dims) (local.get $rank) (i32.const 1)
                                     (global.get $image)
                                     (i32.shr_u (i32.add (global.get $image_len) (i32.const 7)) (i32.const 3))
                                     (i32.const 0))
              (if (i32.load8_u (i32.const 0))
                (then (drop (call $error (i32.load (i32.const 4)))) (return (i32.const -1))))
              (local.set $t (i32.load (i32.const 4))))
            (else
              (local.set $t (call $tensor.new (local.get $dims) (local.get $rank) (i32.const 1)
                                              (global.get $image) (global.get $image_len)))))
          ;; [("input", t)] at 32
          (i32.store (i32.const 32) (i32.const 512))
          (i32.store (i32.const 36) (i32.const 5))
          (i32.store (i32.const 40) (local.get $t))
          (call $ctx.compute (global.get $ctx) (i32.const 32) (i32.const 1) (i32.const 0))
          (if (i32.load8_u (i32.const 0))
            (then (drop (call $error (i32.load (i32.const 4)))) (return (i32.const -1))))
          (local.set $outs (i32.load (i32.const 4)))
          (local.set $count (i32.load (i32.const 8)))
          (if (local.get $words)
            (then
              (call $bulk.words (i32.load offset=8 (local.get $outs)) (i32.const 48))
              (local.set $read (i32.shl (i32.load (i32.const 52)) (i32.const 3))))
            (else
              (call $tensor.data (i32.load offset=8 (local.get $outs)) (i32.const 48))
              (local.set $read (i32.load (i32.const 52)))))
          (local.set $j (i32.const 0))
          (block $dropped
            (loop $drop
              (br_if $dropped (i32.ge_u (local.get $j) (local.get $count)))
              (call $tensor.drop
                (i32.load offset=8 (i32.add (local.get $outs) (i32.mul (local.get $j) (i32.const 12)))))
              (local.set $j (i32.add (local.get $j) (i32.const 1)))
              (br $drop)))
          (call $reset)
          (local.set $i (i32.add (local.get $i) (i32.const 1)))
          (br $next)))
      (local.get $read))

    (func (export "release")
      (if (global.get $ctx) (then (call $ctx.drop (global.get $ctx))))
      (if (global.get $graph) (then (call $graph.drop (global.get $graph))))
      (global.set $ctx (i32.const 0))
      (global.set $graph (i32.const 0)))
  )
  (core instance $main (instantiate $Main
    (with "mem" (instance $mem))
    (with "nn" (instance
      (export "error.code" (func $error.code))
      (export "error.drop" (func $error.drop))
      (export "tensor.new" (func $tensor.new))
      (export "tensor.data" (func $tensor.data))
      (export "tensor.drop" (func $tensor.drop))
      (export "ctx.compute" (func $ctx.compute))
      (export "ctx.drop" (func $ctx.drop))
      (export "graph.init" (func $graph.init))
      (export "graph.load-by-name" (func $graph.load-by-name))
      (export "graph.drop" (func $graph.drop))
      (export "bulk.from-words" (func $bulk.from-words))
      (export "bulk.words" (func $bulk.words))
    ))
  ))

  (func (export "fill") (param "data" (list u8)) (result u32)
    (canon lift (core func $main "fill") (memory $memory) (realloc $realloc)))
  (func (export "prepare") (param "name" string) (result u32)
    (canon lift (core func $main "prepare") (memory $memory) (realloc $realloc)))
  (func (export "infer") (param "n" u32) (param "words" bool) (param "dims" (list u32)) (result u32)
    (canon lift (core func $main "infer") (memory $memory) (realloc $realloc) (post-return $reset1)))
  (func (export "release") (canon lift (core func $main "release")))
)
