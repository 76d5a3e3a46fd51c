;; A hand-written component (component text format) that hands tensor bytes to the host
;; through files in its scratch directory (`wasinn:nn/scratch`, preopened by the host at
;; /.wasinn-scratch) instead of component list values: the guest writes with
;; wasi:filesystem `descriptor.write`, which Wasmtime's WASI host copies in one piece.
;; The same loop as infer_loop.wat, for benchmarks/guest_component.py, plus handle-number
;; wrappers for tests/test_component_scratch.py.
;;
;; Exports:
;;   fill(data: list<u8>) -> u32          keep `data` (the image, < 8 MiB) in guest memory
;;   prepare(name: string) -> u32         load-by-name + init-execution-context; 0 or 1 + code
;;   infer(n: u32, dims: list<u32>) -> u32
;;       n times: write the image to scratch file "in.bin", tensor-from-scratch (FP32, `dims`),
;;       compute with it as "input", tensor-to-scratch of the first output to "out.bin", read
;;       "out.bin" back into guest memory, drop the outputs. Returns the bytes read last time,
;;       or 0xffffffff if a step failed (`last-failure` says which).
;;   last-failure() -> u32                step * 1000 + code of infer's last failure (0: none);
;;       steps: 2 open in.bin, 3 write, 4 tensor-from-scratch, 5 compute, 6 tensor-to-scratch,
;;       7 open out.bin, 8 read; the code is the wasi:filesystem error-code (999: no scratch
;;       preopen, or a short write) or 1 + the wasi-nn error code
;;   release()                            drop the context and the graph
;;   write-file(name: string, data: list<u8>) -> u32
;;       create/replace scratch file `name`: 0, 1 + wasi:filesystem error-code, or 1000 when
;;       there is no /.wasinn-scratch preopen
;;   read-file(name: string, len: u32) -> list<u8>   up to `len` bytes (empty on any error)
;;   from-scratch(name: string, dims: list<u32>, ty: u32) -> result<u32, u32>
;;   to-scratch(t: u32, name: string) -> result<u64, u32>
;;   load-from-scratch(names: list<string>, encoding: u32, target: u32) -> result<u32, u32>
;;       the graph of wasinn:nn/scratch.load-from-scratch (`encoding`, `target`: case indices)
;;   use-graph(g: u32) -> u32             init-execution-context on graph `g`, which then
;;       stands for the prepared graph and context (compute1, release); 0 or 1 + code
;;   compute1(input: string, t: u32) -> result<u32, u32>   first output of a compute on the
;;       prepared context (the other outputs dropped)
;;   tensor-data(t: u32) -> list<u8>; tensor-drop(t: u32)
;;   error-code(e: u32) -> u32; error-data(e: u32) -> string; error-drop(e: u32)
;; `ty` is the tensor-type case index; handles are plain numbers.
(component
  (import "wasi:nn/errors@0.2.0-rc-2024-10-28" (instance $errors
    (export "error" (type $error (sub resource)))
    (type $code (enum "invalid-argument" "invalid-encoding" "timeout" "runtime-error"
                      "unsupported-operation" "too-large" "not-found" "security" "unknown"))
    (export "error-code" (type $code-e (eq $code)))
    (export "[method]error.code" (func (param "self" (borrow $error)) (result $code-e)))
    (export "[method]error.data" (func (param "self" (borrow $error)) (result string)))
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
  (import "wasinn:nn/scratch@0.1.0" (instance $scratch
    (alias outer 1 $tensor-t (type $t-outer))
    (export "tensor" (type $t (eq $t-outer)))
    (alias outer 1 $dims-t (type $d-outer))
    (export "tensor-dimensions" (type $d (eq $d-outer)))
    (alias outer 1 $ty-t (type $ty-outer))
    (export "tensor-type" (type $ty (eq $ty-outer)))
    (alias outer 1 $error (type $e-outer))
    (export "error" (type $e (eq $e-outer)))
    (export "tensor-from-scratch"
      (func (param "name" string) (param "dimensions" $d) (param "ty" $ty)
            (result (result (own $t) (error (own $e))))))
    (export "tensor-to-scratch"
      (func (param "tensor" (borrow $t)) (param "name" string) (result (result u64 (error (own $e))))))
    (alias outer 1 $graph-t (type $g-outer))
    (export "graph" (type $g (eq $g-outer)))
    (type $enc (enum "openvino" "onnx" "tensorflow" "pytorch" "tensorflowlite" "ggml" "autodetect"))
    (export "graph-encoding" (type $enc-e (eq $enc)))
    (type $target (enum "cpu" "gpu" "tpu"))
    (export "execution-target" (type $target-e (eq $target)))
    (export "load-from-scratch"
      (func (param "names" (list string)) (param "encoding" $enc-e) (param "target" $target-e)
            (result (result (own $g) (error (own $e))))))
  ))
  (import "wasi:filesystem/types@0.2.0" (instance $fs
    (export "descriptor" (type $descriptor (sub resource)))
    (type $code (enum "access" "would-block" "already" "bad-descriptor" "busy" "deadlock"
                      "quota" "exist" "file-too-large" "illegal-byte-sequence" "in-progress"
                      "interrupted" "invalid" "io" "is-directory" "loop" "too-many-links"
                      "message-size" "name-too-long" "no-device" "no-entry" "no-lock"
                      "insufficient-memory" "insufficient-space" "not-directory" "not-empty"
                      "not-recoverable" "unsupported" "no-tty" "no-such-device" "overflow"
                      "not-permitted" "pipe" "read-only" "invalid-seek" "text-file-busy"
                      "cross-device"))
    (export "error-code" (type $code-e (eq $code)))
    (type $dflags (flags "read" "write" "file-integrity-sync" "data-integrity-sync"
                         "requested-write-sync" "mutate-directory"))
    (export "descriptor-flags" (type $dflags-e (eq $dflags)))
    (type $pflags (flags "symlink-follow"))
    (export "path-flags" (type $pflags-e (eq $pflags)))
    (type $oflags (flags "create" "directory" "exclusive" "truncate"))
    (export "open-flags" (type $oflags-e (eq $oflags)))
    (export "[method]descriptor.open-at"
      (func (param "self" (borrow $descriptor)) (param "path-flags" $pflags-e) (param "path" string)
            (param "open-flags" $oflags-e) (param "flags" $dflags-e)
            (result (result (own $descriptor) (error $code-e)))))
    (export "[method]descriptor.write"
      (func (param "self" (borrow $descriptor)) (param "buffer" (list u8)) (param "offset" u64)
            (result (result u64 (error $code-e)))))
    (export "[method]descriptor.read"
      (func (param "self" (borrow $descriptor)) (param "length" u64) (param "offset" u64)
            (result (result (tuple (list u8) bool) (error $code-e)))))
  ))
  (alias export $fs "descriptor" (type $descriptor-t))
  (import "wasi:filesystem/preopens@0.2.0" (instance $preopens
    (alias outer 1 $descriptor-t (type $d-outer))
    (export "descriptor" (type $d (eq $d-outer)))
    (export "get-directories" (func (result (list (tuple (own $d) string)))))
  ))

  ;; memory: [0, 1 KiB) return areas and constants; [64 KiB, 8 MiB) the image;
  ;; from 8 MiB a bump heap that every export call empties again.
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
  (core func $error.data (canon lower (func $errors "[method]error.data") (memory $memory) (realloc $realloc)))
  (core func $error.drop (canon resource.drop $error))
  (core func $tensor.data (canon lower (func $tensor "[method]tensor.data") (memory $memory) (realloc $realloc)))
  (core func $tensor.drop (canon resource.drop $tensor-t))
  (core func $ctx.compute (canon lower (func $inference "[method]graph-execution-context.compute")
                                 (memory $memory) (realloc $realloc)))
  (core func $ctx.drop (canon resource.drop $ctx-t))
  (core func $graph.init (canon lower (func $graph "[method]graph.init-execution-context") (memory $memory)))
  (core func $graph.load-by-name (canon lower (func $graph "load-by-name") (memory $memory)))
  (core func $graph.drop (canon resource.drop $graph-t))
  (core func $scratch.from (canon lower (func $scratch "tensor-from-scratch") (memory $memory)))
  (core func $scratch.to (canon lower (func $scratch "tensor-to-scratch") (memory $memory)))
  (core func $scratch.load (canon lower (func $scratch "load-from-scratch") (memory $memory)))
  (core func $fs.open-at (canon lower (func $fs "[method]descriptor.open-at") (memory $memory)))
  (core func $fs.write (canon lower (func $fs "[method]descriptor.write") (memory $memory)))
  (core func $fs.read (canon lower (func $fs "[method]descriptor.read") (memory $memory) (realloc $realloc)))
  (core func $fs.drop (canon resource.drop $descriptor-t))
  (core func $fs.preopens (canon lower (func $preopens "get-directories") (memory $memory) (realloc $realloc)))

  (core module $Main
    (import "nn" "error.code" (func $error.code (param i32) (result i32)))
    (import "nn" "error.data" (func $error.data (param i32 i32)))
    (import "nn" "error.drop" (func $error.drop (param i32)))
    (import "nn" "tensor.data" (func $tensor.data (param i32 i32)))
    (import "nn" "tensor.drop" (func $tensor.drop (param i32)))
    (import "nn" "ctx.compute" (func $ctx.compute (param i32 i32 i32 i32)))
    (import "nn" "ctx.drop" (func $ctx.drop (param i32)))
    (import "nn" "graph.init" (func $graph.init (param i32 i32)))
    (import "nn" "graph.load-by-name" (func $graph.load-by-name (param i32 i32 i32)))
    (import "nn" "graph.drop" (func $graph.drop (param i32)))
    (import "nn" "scratch.from" (func $scratch.from (param i32 i32 i32 i32 i32 i32)))
    (import "nn" "scratch.to" (func $scratch.to (param i32 i32 i32 i32)))
    (import "nn" "scratch.load" (func $scratch.load (param i32 i32 i32 i32 i32)))
    (import "fs" "open-at" (func $fs.open-at (param i32 i32 i32 i32 i32 i32 i32)))
    (import "fs" "write" (func $fs.write (param i32 i32 i32 i64 i32)))
    (import "fs" "read" (func $fs.read (param i32 i64 i64 i32)))
    (import "fs" "drop" (func $fs.drop (param i32)))
    (import "fs" "preopens" (func $fs.preopens (param i32)))
    (import "mem" "memory" (memory 1))
    (import "mem" "reset" (func $reset))
    (data (i32.const 512) "input")
    (data (i32.const 600) "/.wasinn-scratch")
    (data (i32.const 640) "in.bin")
    (data (i32.const 656) "out.bin")
    (global $image i32 (i32.const 65536))
    (global $image_len (mut i32) (i32.const 0))
    (global $graph (mut i32) (i32.const 0))
    (global $ctx (mut i32) (i32.const 0))
    (global $dir (mut i32) (i32.const -1))
    (global $failure (mut i32) (i32.const 0))

    ;; ---- helpers --------------------------------------------------------------------
    (func $error (param $e i32) (result i32)
      (local $code i32)
      (local.set $code (call $error.code (local.get $e)))
      (call $error.drop (local.get $e))
      (i32.add (local.get $code) (i32.const 1)))

    ;; the handle of the /.wasinn-scratch preopen, or -1 (looked up once)
    (func $scratch-dir (result i32)
      (local $list i32) (local $len i32) (local $i i32) (local $entry i32) (local $k i32)
      (if (i32.ge_s (global.get $dir) (i32.const 0)) (then (return (global.get $dir))))
      (call $fs.preopens (i32.const 16))
      (local.set $list (i32.load (i32.const 16)))
      (local.set $len (i32.load (i32.const 20)))
      (block $done
        (loop $next
          (br_if $done (i32.ge_u (local.get $i) (local.get $len)))
          (local.set $entry (i32.add (local.get $list) (i32.mul (local.get $i) (i32.const 12))))
          (if (i32.eq (i32.load offset=8 (local.get $entry)) (i32.const 16))
            (then
              (local.set $k (i32.const 0))
              (block $differ
                (loop $cmp
                  (if (i32.eq (local.get $k) (i32.const 16))
                    (then (global.set $dir (i32.load (local.get $entry))) (br $done)))
                  (br_if $differ (i32.ne
                    (i32.load8_u (i32.add (i32.load offset=4 (local.get $entry)) (local.get $k)))
                    (i32.load8_u (i32.add (i32.const 600) (local.get $k)))))
                  (local.set $k (i32.add (local.get $k) (i32.const 1)))
                  (br $cmp)))))
          (local.set $i (i32.add (local.get $i) (i32.const 1)))
          (br $next)))
      (global.get $dir))

    ;; open scratch file (name, len) with open-flags/descriptor-flags: handle, or -(1 + code)
    ;; (-1000 without a scratch preopen)
    (func $open (param $name i32) (param $len i32) (param $oflags i32) (param $dflags i32)
          (result i32)
      (local $dir i32)
      (local.set $dir (call $scratch-dir))
      (if (i32.lt_s (local.get $dir) (i32.const 0)) (then (return (i32.const -1000))))
      (call $fs.open-at (local.get $dir) (i32.const 0) (local.get $name) (local.get $len)
                        (local.get $oflags) (local.get $dflags) (i32.const 0))
      (if (i32.load8_u (i32.const 0))
        (then (return (i32.sub (i32.const -1) (i32.load8_u (i32.const 4))))))
      (i32.load (i32.const 4)))

    (func $fail (param $step i32) (param $code i32) (result i32)
      (global.set $failure (i32.add (i32.mul (local.get $step) (i32.const 1000)) (local.get $code)))
      (call $reset)
      (i32.const -1))

    ;; ---- the benchmark loop ---------------------------------------------------------
    (func (export "fill") (param $ptr i32) (param $len i32) (result i32)
      (memory.copy (global.get $image) (local.get $ptr) (local.get $len))
      (global.set $image_len (local.get $len))
      (call $reset)
      (local.get $len))

    (func (export "prepare") (param $name i32) (param $len i32) (result i32)
      (call $graph.load-by-name (local.get $name) (local.get $len) (i32.const 0))
      (if (i32.load8_u (i32.const 0)) (then (return (call $error (i32.load (i32.const 4))))))
      (global.set $graph (i32.load (i32.const 4)))
      (call $graph.init (global.get $graph) (i32.const 0))
      (if (i32.load8_u (i32.const 0)) (then (return (call $error (i32.load (i32.const 4))))))
      (global.set $ctx (i32.load (i32.const 4)))
      (call $reset)
      (i32.const 0))

    (func (export "infer") (param $n i32) (param $dims i32) (param $rank i32) (result i32)
      (local $i i32) (local $t i32) (local $outs i32) (local $count i32) (local $j i32)
      (local $read i32) (local $in i32) (local $out i32) (local $size i32)
      (global.set $failure (i32.const 0))
      (memory.copy (i32.const 256) (local.get $dims) (i32.shl (local.get $rank) (i32.const 2)))
      (local.set $dims (i32.const 256))
      (local.set $out (i32.const -1))
      ;; create|truncate, read|write
      (local.set $in (call $open (i32.const 640) (i32.const 6) (i32.const 9) (i32.const 3)))
      (if (i32.lt_s (local.get $in) (i32.const 0))
        (then (return (call $fail (i32.const 2) (i32.sub (i32.const -1) (local.get $in))))))
      (block $done
        (loop $next
          (br_if $done (i32.ge_u (local.get $i) (local.get $n)))
          (call $fs.write (local.get $in) (global.get $image) (global.get $image_len)
                          (i64.const 0) (i32.const 0))
          (if (i32.load8_u (i32.const 0))
            (then (return (call $fail (i32.const 3) (i32.load8_u (i32.const 8))))))
          (if (i64.ne (i64.load (i32.const 8)) (i64.extend_i32_u (global.get $image_len)))
            (then (return (call $fail (i32.const 3) (i32.const 999)))))
          (call $scratch.from (i32.const 640) (i32.const 6) (local.get $dims) (local.get $rank)
                              (i32.const 1) (i32.const 0))
          (if (i32.load8_u (i32.const 0))
            (then (return (call $fail (i32.const 4) (call $error (i32.load (i32.const 4)))))))
          (local.set $t (i32.load (i32.const 4)))
          ;; [("input", t)] at 32
          (i32.store (i32.const 32) (i32.const 512))
          (i32.store (i32.const 36) (i32.const 5))
          (i32.store (i32.const 40) (local.get $t))
          (call $ctx.compute (global.get $ctx) (i32.const 32) (i32.const 1) (i32.const 0))
          (if (i32.load8_u (i32.const 0))
            (then (return (call $fail (i32.const 5) (call $error (i32.load (i32.const 4)))))))
          (local.set $outs (i32.load (i32.const 4)))
          (local.set $count (i32.load (i32.const 8)))
          (call $scratch.to (i32.load offset=8 (local.get $outs)) (i32.const 656) (i32.const 7)
                            (i32.const 0))
          (if (i32.load8_u (i32.const 0))
            (then (return (call $fail (i32.const 6) (call $error (i32.load (i32.const 8)))))))
          (local.set $size (i32.wrap_i64 (i64.load (i32.const 8))))
          (if (i32.lt_s (local.get $out) (i32.const 0))
            (then
              (local.set $out (call $open (i32.const 656) (i32.const 7) (i32.const 0) (i32.const 1)))
              (if (i32.lt_s (local.get $out) (i32.const 0))
                (then (return (call $fail (i32.const 7) (i32.sub (i32.const -1) (local.get $out))))))))
          (call $fs.read (local.get $out) (i64.extend_i32_u (local.get $size)) (i64.const 0)
                         (i32.const 48))
          (if (i32.load8_u (i32.const 48))
            (then (return (call $fail (i32.const 8) (i32.load8_u (i32.const 52))))))
          (local.set $read (i32.load (i32.const 56)))
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
      (call $fs.drop (local.get $in))
      (if (i32.ge_s (local.get $out) (i32.const 0)) (then (call $fs.drop (local.get $out))))
      (local.get $read))

    (func (export "last-failure") (result i32) (global.get $failure))

    (func (export "release")
      (if (global.get $ctx) (then (call $ctx.drop (global.get $ctx))))
      (if (global.get $graph) (then (call $graph.drop (global.get $graph))))
      (global.set $ctx (i32.const 0))
      (global.set $graph (i32.const 0)))

    ;; ---- wrappers for the tests -----------------------------------------------------
    (func (export "write-file") (param $name i32) (param $len i32) (param $data i32)
          (param $size i32) (result i32)
      (local $fd i32) (local $code i32)
      (local.set $fd (call $open (local.get $name) (local.get $len) (i32.const 9) (i32.const 3)))
      (if (i32.lt_s (local.get $fd) (i32.const 0))
        (then (call $reset) (return (i32.sub (i32.const 0) (local.get $fd)))))
      (call $fs.write (local.get $fd) (local.get $data) (local.get $size) (i64.const 0) (i32.const 0))
      (if (i32.load8_u (i32.const 0))
        (then (local.set $code (i32.add (i32.load8_u (i32.const 8)) (i32.const 1)))))
      (call $fs.drop (local.get $fd))
      (call $reset)
      (local.get $code))

    (func (export "read-file") (param $name i32) (param $len i32) (param $size i32) (result i32)
      (local $fd i32)
      (i64.store (i32.const 80) (i64.const 0))
      (local.set $fd (call $open (local.get $name) (local.get $len) (i32.const 0) (i32.const 1)))
      (if (i32.lt_s (local.get $fd) (i32.const 0)) (then (return (i32.const 80))))
      (call $fs.read (local.get $fd) (i64.extend_i32_u (local.get $size)) (i64.const 0) (i32.const 48))
      (call $fs.drop (local.get $fd))
      (if (i32.eqz (i32.load8_u (i32.const 48)))
        (then (i64.store (i32.const 80) (i64.load (i32.const 52)))))
      (i32.const 80))

    ;; result<own tensor, own error> and result<u32, u32> share one layout: forward as is
    (func (export "from-scratch") (param $name i32) (param $len i32) (param $dims i32)
          (param $rank i32) (param $ty i32) (result i32)
      (call $scratch.from (local.get $name) (local.get $len) (local.get $dims) (local.get $rank)
                          (local.get $ty) (i32.const 64))
      (i32.const 64))

    (func (export "to-scratch") (param $t i32) (param $name i32) (param $len i32) (result i32)
      (call $scratch.to (local.get $t) (local.get $name) (local.get $len) (i32.const 64))
      (i32.const 64))

    ;; the names arrive as the import takes them (pairs of string pointer and length)
    (func (export "load-from-scratch") (param $names i32) (param $count i32) (param $enc i32)
          (param $target i32) (result i32)
      (call $scratch.load (local.get $names) (local.get $count) (local.get $enc)
                          (local.get $target) (i32.const 64))
      (i32.const 64))

    (func (export "use-graph") (param $g i32) (result i32)
      (global.set $graph (local.get $g))
      (call $graph.init (local.get $g) (i32.const 0))
      (if (i32.load8_u (i32.const 0)) (then (return (call $error (i32.load (i32.const 4))))))
      (global.set $ctx (i32.load (i32.const 4)))
      (i32.const 0))

    (func (export "compute1") (param $name i32) (param $len i32) (param $t i32) (result i32)
      (local $outs i32) (local $count i32) (local $j i32)
      (i32.store (i32.const 32) (local.get $name))
      (i32.store (i32.const 36) (local.get $len))
      (i32.store (i32.const 40) (local.get $t))
      (call $ctx.compute (global.get $ctx) (i32.const 32) (i32.const 1) (i32.const 64))
      (if (i32.load8_u (i32.const 64)) (then (return (i32.const 64))))
      (local.set $outs (i32.load (i32.const 68)))
      (local.set $count (i32.load (i32.const 72)))
      (i32.store (i32.const 68) (i32.load offset=8 (local.get $outs)))
      (local.set $j (i32.const 1))
      (block $dropped
        (loop $drop
          (br_if $dropped (i32.ge_u (local.get $j) (local.get $count)))
          (call $tensor.drop
            (i32.load offset=8 (i32.add (local.get $outs) (i32.mul (local.get $j) (i32.const 12)))))
          (local.set $j (i32.add (local.get $j) (i32.const 1)))
          (br $drop)))
      (i32.const 64))

    (func (export "tensor-data") (param $t i32) (result i32)
      (call $tensor.data (local.get $t) (i32.const 80)) (i32.const 80))
    (func (export "tensor-drop") (param $t i32) (call $tensor.drop (local.get $t)))
    (func (export "error-code") (param $e i32) (result i32) (call $error.code (local.get $e)))
    (func (export "error-data") (param $e i32) (result i32)
      (call $error.data (local.get $e) (i32.const 80)) (i32.const 80))
    (func (export "error-drop") (param $e i32) (call $error.drop (local.get $e)))
  )
  (core instance $main (instantiate $Main
    (with "mem" (instance $mem))
    (with "nn" (instance
      (export "error.code" (func $error.code))
      (export "error.data" (func $error.data))
      (export "error.drop" (func $error.drop))
      (export "tensor.data" (func $tensor.data))
      (export "tensor.drop" (func $tensor.drop))
      (export "ctx.compute" (func $ctx.compute))
      (export "ctx.drop" (func $ctx.drop))
      (export "graph.init" (func $graph.init))
      (export "graph.load-by-name" (func $graph.load-by-name))
      (export "graph.drop" (func $graph.drop))
      (export "scratch.from" (func $scratch.from))
      (export "scratch.to" (func $scratch.to))
      (export "scratch.load" (func $scratch.load))
    ))
    (with "fs" (instance
      (export "open-at" (func $fs.open-at))
      (export "write" (func $fs.write))
      (export "read" (func $fs.read))
      (export "drop" (func $fs.drop))
      (export "preopens" (func $fs.preopens))
    ))
  ))

  (type $result-u32 (result u32 (error u32)))
  (type $result-u64 (result u64 (error u32)))
  (func (export "fill") (param "data" (list u8)) (result u32)
    (canon lift (core func $main "fill") (memory $memory) (realloc $realloc)))
  (func (export "prepare") (param "name" string) (result u32)
    (canon lift (core func $main "prepare") (memory $memory) (realloc $realloc)))
  (func (export "infer") (param "n" u32) (param "dims" (list u32)) (result u32)
    (canon lift (core func $main "infer") (memory $memory) (realloc $realloc) (post-return $reset1)))
  (func (export "last-failure") (result u32) (canon lift (core func $main "last-failure")))
  (func (export "release") (canon lift (core func $main "release")))
  (func (export "write-file") (param "name" string) (param "data" (list u8)) (result u32)
    (canon lift (core func $main "write-file") (memory $memory) (realloc $realloc)))
  (func (export "read-file") (param "name" string) (param "len" u32) (result (list u8))
    (canon lift (core func $main "read-file") (memory $memory) (realloc $realloc) (post-return $reset1)))
  (func (export "from-scratch") (param "name" string) (param "dims" (list u32)) (param "ty" u32)
        (result $result-u32)
    (canon lift (core func $main "from-scratch") (memory $memory) (realloc $realloc) (post-return $reset1)))
  (func (export "to-scratch") (param "t" u32) (param "name" string) (result $result-u64)
    (canon lift (core func $main "to-scratch") (memory $memory) (realloc $realloc) (post-return $reset1)))
  (func (export "load-from-scratch") (param "names" (list string)) (param "encoding" u32)
        (param "target" u32) (result $result-u32)
    (canon lift (core func $main "load-from-scratch") (memory $memory) (realloc $realloc)
                (post-return $reset1)))
  (func (export "use-graph") (param "g" u32) (result u32) (canon lift (core func $main "use-graph")))
  (func (export "compute1") (param "input" string) (param "t" u32) (result $result-u32)
    (canon lift (core func $main "compute1") (memory $memory) (realloc $realloc) (post-return $reset1)))
  (func (export "tensor-data") (param "t" u32) (result (list u8))
    (canon lift (core func $main "tensor-data") (memory $memory) (realloc $realloc) (post-return $reset1)))
  (func (export "tensor-drop") (param "t" u32) (canon lift (core func $main "tensor-drop")))
  (func (export "error-code") (param "e" u32) (result u32) (canon lift (core func $main "error-code")))
  (func (export "error-data") (param "e" u32) (result string)
    (canon lift (core func $main "error-data") (memory $memory) (realloc $realloc) (post-return $reset1)))
  (func (export "error-drop") (param "e" u32) (canon lift (core func $main "error-drop")))
)
