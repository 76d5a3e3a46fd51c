;; A hand-written component (component text format) for the earlier wasi:nn release
;; candidates, 2024-08-19 and 2024-06-25, whose context has set-input / compute /
;; get-output by name. `@VERSION@` stands for the release candidate; lines ending in
;; `;;@0625` exist only in 2024-06-25 (the error constructor) and are removed for
;; 2024-08-19 (tests/component_guests.py does both). Like shim_1028.wat it exports every
;; wasi-nn function as a plain function over handle numbers and forwards each call.
(component
  ;; ---- imports ----------------------------------------------------------------------
  (import "wasi:nn/errors@@VERSION@" (instance $errors
    (export "error" (type $error (sub resource)))
    (type $code (enum "invalid-argument" "invalid-encoding" "timeout" "runtime-error"
                      "unsupported-operation" "too-large" "not-found" "security" "unknown"))
    (export "error-code" (type $code-e (eq $code)))
    (export "[method]error.code" (func (param "self" (borrow $error)) (result $code-e)))
    (export "[method]error.data" (func (param "self" (borrow $error)) (result string)))
    (export "[constructor]error" (func (param "code" $code-e) (param "data" string) (result (own $error)))) ;;@0625
  ))
  (alias export $errors "error" (type $error))

  (import "wasi:nn/tensor@@VERSION@" (instance $tensor
    (export "tensor" (type $tensor (sub resource)))
    (type $dims (list u32))
    (export "tensor-dimensions" (type $dims-e (eq $dims)))
    (type $ty (enum "FP16" "FP32" "FP64" "BF16" "U8" "I32" "I64"))
    (export "tensor-type" (type $ty-e (eq $ty)))
    (type $data (list u8))
    (export "tensor-data" (type $data-e (eq $data)))
    (export "[constructor]tensor"
      (func (param "dimensions" $dims-e) (param "ty" $ty-e) (param "data" $data-e) (result (own $tensor))))
    (export "[method]tensor.dimensions" (func (param "self" (borrow $tensor)) (result $dims-e)))
    (export "[method]tensor.ty" (func (param "self" (borrow $tensor)) (result $ty-e)))
    (export "[method]tensor.data" (func (param "self" (borrow $tensor)) (result $data-e)))
  ))
  (alias export $tensor "tensor" (type $tensor-t))
  (alias export $tensor "tensor-dimensions" (type $dims-t))
  (alias export $tensor "tensor-type" (type $ty-t))

  (import "wasi:nn/inference@@VERSION@" (instance $inference
    (export "graph-execution-context" (type $ctx (sub resource)))
    (alias outer 1 $tensor-t (type $t-outer))
    (export "tensor" (type $t (eq $t-outer)))
    (alias outer 1 $error (type $e-outer))
    (export "error" (type $e (eq $e-outer)))
    (export "[method]graph-execution-context.set-input"
      (func (param "self" (borrow $ctx)) (param "name" string) (param "tensor" (own $t))
            (result (result (error (own $e))))))
    (export "[method]graph-execution-context.compute"
      (func (param "self" (borrow $ctx)) (result (result (error (own $e))))))
    (export "[method]graph-execution-context.get-output"
      (func (param "self" (borrow $ctx)) (param "name" string) (result (result (own $t) (error (own $e))))))
  ))
  (alias export $inference "graph-execution-context" (type $ctx-t))

  (import "wasi:nn/graph@@VERSION@" (instance $graph
    (export "graph" (type $graph (sub resource)))
    (alias outer 1 $error (type $e-outer))
    (export "error" (type $e (eq $e-outer)))
    (alias outer 1 $tensor-t (type $t-outer))
    (export "tensor" (type $t (eq $t-outer)))
    (alias outer 1 $ctx-t (type $c-outer))
    (export "graph-execution-context" (type $c (eq $c-outer)))
    (type $enc (enum "openvino" "onnx" "tensorflow" "pytorch" "tensorflowlite" "ggml" "autodetect"))
    (export "graph-encoding" (type $enc-e (eq $enc)))
    (type $target (enum "cpu" "gpu" "tpu"))
    (export "execution-target" (type $target-e (eq $target)))
    (type $builder (list u8))
    (export "graph-builder" (type $builder-e (eq $builder)))
    (export "[method]graph.init-execution-context"
      (func (param "self" (borrow $graph)) (result (result (own $c) (error (own $e))))))
    (export "load"
      (func (param "builder" (list $builder-e)) (param "encoding" $enc-e) (param "target" $target-e)
            (result (result (own $graph) (error (own $e))))))
    (export "load-by-name"
      (func (param "name" string) (result (result (own $graph) (error (own $e))))))
  ))
  (alias export $graph "graph" (type $graph-t))
  (alias export $graph "execution-target" (type $target-t))

  ;; ---- memory and allocator, instantiated first to break the lower/lift cycle ---------
  (core module $Mem
    (memory (export "memory") 1)
    (global $bump (mut i32) (i32.const 1024))
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
      (if (local.get $old_size)
        (then (memory.copy (local.get $p) (local.get $old) (local.get $old_size))))
      (local.get $p))
    ;; post-return of every export: the host has copied the results out
    (func (export "reset") (param i32) (global.set $bump (i32.const 1024)))
    (func (export "reset0") (global.set $bump (i32.const 1024)))
  )
  (core instance $mem (instantiate $Mem))
  (alias core export $mem "memory" (core memory $memory))
  (alias core export $mem "realloc" (core func $realloc))
  (alias core export $mem "reset" (core func $reset))
  (alias core export $mem "reset0" (core func $reset0))

  ;; ---- lowered imports --------------------------------------------------------------
  (core func $error.code (canon lower (func $errors "[method]error.code")))
  (core func $error.data (canon lower (func $errors "[method]error.data") (memory $memory) (realloc $realloc)))
  (core func $error.drop (canon resource.drop $error))
  (core func $error.new (canon lower (func $errors "[constructor]error") (memory $memory))) ;;@0625
  (core func $tensor.new (canon lower (func $tensor "[constructor]tensor") (memory $memory)))
  (core func $tensor.dims (canon lower (func $tensor "[method]tensor.dimensions") (memory $memory) (realloc $realloc)))
  (core func $tensor.ty (canon lower (func $tensor "[method]tensor.ty")))
  (core func $tensor.data (canon lower (func $tensor "[method]tensor.data") (memory $memory) (realloc $realloc)))
  (core func $tensor.drop (canon resource.drop $tensor-t))
  (core func $ctx.set-input (canon lower (func $inference "[method]graph-execution-context.set-input")
                                   (memory $memory)))
  (core func $ctx.compute (canon lower (func $inference "[method]graph-execution-context.compute")
                                 (memory $memory)))
  (core func $ctx.get-output (canon lower (func $inference "[method]graph-execution-context.get-output")
                                    (memory $memory)))
  (core func $ctx.drop (canon resource.drop $ctx-t))
  (core func $graph.init (canon lower (func $graph "[method]graph.init-execution-context") (memory $memory)))
  (core func $graph.load (canon lower (func $graph "load") (memory $memory)))
  (core func $graph.load-by-name (canon lower (func $graph "load-by-name") (memory $memory)))
  (core func $graph.drop (canon resource.drop $graph-t))

  ;; ---- the forwarding core module ---------------------------------------------------
  (core module $Main
    (import "nn" "error.code" (func $error.code (param i32) (result i32)))
    (import "nn" "error.data" (func $error.data (param i32 i32)))
    (import "nn" "error.drop" (func $error.drop (param i32)))
    (import "nn" "error.new" (func $error.new (param i32 i32 i32) (result i32))) ;;@0625
    (import "nn" "tensor.new" (func $tensor.new (param i32 i32 i32 i32 i32) (result i32)))
    (import "nn" "tensor.dims" (func $tensor.dims (param i32 i32)))
    (import "nn" "tensor.ty" (func $tensor.ty (param i32) (result i32)))
    (import "nn" "tensor.data" (func $tensor.data (param i32 i32)))
    (import "nn" "tensor.drop" (func $tensor.drop (param i32)))
    (import "nn" "ctx.set-input" (func $ctx.set-input (param i32 i32 i32 i32 i32)))
    (import "nn" "ctx.compute" (func $ctx.compute (param i32 i32)))
    (import "nn" "ctx.get-output" (func $ctx.get-output (param i32 i32 i32 i32)))
    (import "nn" "ctx.drop" (func $ctx.drop (param i32)))
    (import "nn" "graph.init" (func $graph.init (param i32 i32)))
    (import "nn" "graph.load" (func $graph.load (param i32 i32 i32 i32 i32)))
    (import "nn" "graph.load-by-name" (func $graph.load-by-name (param i32 i32 i32)))
    (import "nn" "graph.drop" (func $graph.drop (param i32)))
    (import "mem" "memory" (memory 1))
    ;; the return area of every forwarded call
    (global $ret i32 (i32.const 16))

    (func (export "error-code") (param i32) (result i32) (call $error.code (local.get 0)))
    (func (export "error-data") (param i32) (result i32)
      (call $error.data (local.get 0) (global.get $ret)) (global.get $ret))
    (func (export "error-drop") (param i32) (call $error.drop (local.get 0)))
    (func (export "error-new") (param i32 i32 i32) (result i32) ;;@0625
      (call $error.new (local.get 0) (local.get 1) (local.get 2))) ;;@0625

    (func (export "tensor-new") (param i32 i32 i32 i32 i32) (result i32)
      (call $tensor.new (local.get 0) (local.get 1) (local.get 2) (local.get 3) (local.get 4)))
    (func (export "tensor-dims") (param i32) (result i32)
      (call $tensor.dims (local.get 0) (global.get $ret)) (global.get $ret))
    (func (export "tensor-ty") (param i32) (result i32) (call $tensor.ty (local.get 0)))
    (func (export "tensor-data") (param i32) (result i32)
      (call $tensor.data (local.get 0) (global.get $ret)) (global.get $ret))
    (func (export "tensor-drop") (param i32) (call $tensor.drop (local.get 0)))

    (func (export "set-input") (param i32 i32 i32 i32) (result i32)
      (call $ctx.set-input (local.get 0) (local.get 1) (local.get 2) (local.get 3) (global.get $ret))
      (global.get $ret))
    (func (export "compute") (param i32) (result i32)
      (call $ctx.compute (local.get 0) (global.get $ret)) (global.get $ret))
    (func (export "get-output") (param i32 i32 i32) (result i32)
      (call $ctx.get-output (local.get 0) (local.get 1) (local.get 2) (global.get $ret)) (global.get $ret))
    (func (export "ctx-drop") (param i32) (call $ctx.drop (local.get 0)))

    (func (export "init") (param i32) (result i32)
      (call $graph.init (local.get 0) (global.get $ret)) (global.get $ret))
    (func (export "load") (param i32 i32 i32 i32) (result i32)
      (call $graph.load (local.get 0) (local.get 1) (local.get 2) (local.get 3) (global.get $ret))
      (global.get $ret))
    (func (export "load-by-name") (param i32 i32) (result i32)
      (call $graph.load-by-name (local.get 0) (local.get 1) (global.get $ret)) (global.get $ret))
    (func (export "graph-drop") (param i32) (call $graph.drop (local.get 0)))

    (func (export "trap") unreachable)
    (func (export "spin") (loop $forever (br $forever)))
  )
  (core instance $main (instantiate $Main
    (with "mem" (instance $mem))
    (with "nn" (instance
      (export "error.code" (func $error.code))
      (export "error.data" (func $error.data))
      (export "error.drop" (func $error.drop))
      (export "error.new" (func $error.new)) ;;@0625
      (export "tensor.new" (func $tensor.new))
      (export "tensor.dims" (func $tensor.dims))
      (export "tensor.ty" (func $tensor.ty))
      (export "tensor.data" (func $tensor.data))
      (export "tensor.drop" (func $tensor.drop))
      (export "ctx.set-input" (func $ctx.set-input))
      (export "ctx.compute" (func $ctx.compute))
      (export "ctx.get-output" (func $ctx.get-output))
      (export "ctx.drop" (func $ctx.drop))
      (export "graph.init" (func $graph.init))
      (export "graph.load" (func $graph.load))
      (export "graph.load-by-name" (func $graph.load-by-name))
      (export "graph.drop" (func $graph.drop))
    ))
  ))

  ;; ---- exports ----------------------------------------------------------------------
  (type $handle-result (result u32 (error u32)))
  (type $unit-result (result (error u32)))

  (func (export "error-code") (param "e" u32) (result u8)
    (canon lift (core func $main "error-code")))
  (func (export "error-data") (param "e" u32) (result string)
    (canon lift (core func $main "error-data") (memory $memory) (realloc $realloc) (post-return $reset)))
  (func (export "error-drop") (param "e" u32)
    (canon lift (core func $main "error-drop")))
  (func (export "error-new") (param "code" u8) (param "data" string) (result u32) ;;@0625
    (canon lift (core func $main "error-new") (memory $memory) (realloc $realloc) (post-return $reset))) ;;@0625

  (func (export "tensor-new") (param "dims" (list u32)) (param "ty" u8) (param "data" (list u8)) (result u32)
    (canon lift (core func $main "tensor-new") (memory $memory) (realloc $realloc) (post-return $reset)))
  (func (export "tensor-dims") (param "t" u32) (result (list u32))
    (canon lift (core func $main "tensor-dims") (memory $memory) (realloc $realloc) (post-return $reset)))
  (func (export "tensor-ty") (param "t" u32) (result u8)
    (canon lift (core func $main "tensor-ty")))
  (func (export "tensor-data") (param "t" u32) (result (list u8))
    (canon lift (core func $main "tensor-data") (memory $memory) (realloc $realloc) (post-return $reset)))
  (func (export "tensor-drop") (param "t" u32)
    (canon lift (core func $main "tensor-drop")))

  (func (export "set-input") (param "ctx" u32) (param "name" string) (param "t" u32) (result $unit-result)
    (canon lift (core func $main "set-input") (memory $memory) (realloc $realloc) (post-return $reset)))
  (func (export "compute") (param "ctx" u32) (result $unit-result)
    (canon lift (core func $main "compute") (memory $memory) (realloc $realloc) (post-return $reset)))
  (func (export "get-output") (param "ctx" u32) (param "name" string) (result $handle-result)
    (canon lift (core func $main "get-output") (memory $memory) (realloc $realloc) (post-return $reset)))
  (func (export "ctx-drop") (param "ctx" u32)
    (canon lift (core func $main "ctx-drop")))

  (func (export "init") (param "graph" u32) (result $handle-result)
    (canon lift (core func $main "init") (memory $memory) (realloc $realloc) (post-return $reset)))
  (func (export "load") (param "builders" (list (list u8))) (param "encoding" u8) (param "target" u8)
        (result $handle-result)
    (canon lift (core func $main "load") (memory $memory) (realloc $realloc) (post-return $reset)))
  (func (export "load-by-name") (param "name" string) (result $handle-result)
    (canon lift (core func $main "load-by-name") (memory $memory) (realloc $realloc) (post-return $reset)))
  (func (export "graph-drop") (param "graph" u32)
    (canon lift (core func $main "graph-drop")))

  (func (export "trap") (canon lift (core func $main "trap")))
  (func (export "spin") (canon lift (core func $main "spin")))
)
