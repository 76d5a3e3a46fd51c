;; Core module of the chaining guest (world `chain` in world.wit), written by hand in WAT.
;; `wasm-tools component embed` + `component new` turn it into a component.
;;
;; Canonical ABI shapes used here (wasi:nn 2024-10-28):
;;   result<own<R>, own<error>>  -> retptr: [disc u8 @0][handle i32 @4]
;;   result<list<T>, own<error>> -> retptr: [disc u8 @0][ptr i32 @4][len i32 @8 | error @4]
;;   named-tensor                -> [name ptr i32][name len i32][tensor handle i32], 12 bytes
;; Handles are never 0, so 0 marks "not held".
(module
  (import "wasi:nn/graph@0.2.0-rc-2024-10-28" "load-by-name"
    (func $load_by_name (param i32 i32 i32)))
  (import "wasi:nn/graph@0.2.0-rc-2024-10-28" "[method]graph.init-execution-context"
    (func $init_ctx (param i32 i32)))
  (import "wasi:nn/graph@0.2.0-rc-2024-10-28" "[resource-drop]graph"
    (func $drop_graph (param i32)))
  (import "wasi:nn/inference@0.2.0-rc-2024-10-28" "[method]graph-execution-context.compute"
    (func $compute (param i32 i32 i32 i32)))
  (import "wasi:nn/inference@0.2.0-rc-2024-10-28" "[resource-drop]graph-execution-context"
    (func $drop_ctx (param i32)))
  (import "wasi:nn/tensor@0.2.0-rc-2024-10-28" "[constructor]tensor"
    (func $tensor_new (param i32 i32 i32 i32 i32) (result i32)))
  (import "wasi:nn/tensor@0.2.0-rc-2024-10-28" "[method]tensor.data"
    (func $tensor_data (param i32 i32)))
  (import "wasi:nn/tensor@0.2.0-rc-2024-10-28" "[resource-drop]tensor"
    (func $drop_tensor (param i32)))
  (import "wasi:nn/errors@0.2.0-rc-2024-10-28" "[method]error.data"
    (func $error_data (param i32 i32)))
  (import "wasi:nn/errors@0.2.0-rc-2024-10-28" "[resource-drop]error"
    (func $drop_error (param i32)))

  (memory (export "memory") 2)
  (global $heap_base i32 (i32.const 65536))
  (global $bump (mut i32) (i32.const 65536))

  ;; handles held by the current call
  (global $g1 (mut i32) (i32.const 0))
  (global $g2 (mut i32) (i32.const 0))
  (global $c1 (mut i32) (i32.const 0))
  (global $c2 (mut i32) (i32.const 0))

  ;; scratch: call return areas at 0..63, the export's return area at 64..79
  (func (export "cabi_realloc") (param $old i32) (param $old_size i32) (param $align i32)
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

  ;; Drop every owned tensor of a list<named-tensor> at (ptr, len), except index $keep.
  (func $drop_outputs (param $ptr i32) (param $len i32) (param $keep i32)
    (local $i i32)
    (block $done
      (loop $next
        (br_if $done (i32.ge_u (local.get $i) (local.get $len)))
        (if (i32.ne (local.get $i) (local.get $keep))
          (then (call $drop_tensor
                  (i32.load offset=8 (i32.add (local.get $ptr) (i32.mul (local.get $i) (i32.const 12)))))))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $next))))

  (func $release
    (if (global.get $c1) (then (call $drop_ctx (global.get $c1))))
    (if (global.get $c2) (then (call $drop_ctx (global.get $c2))))
    (if (global.get $g1) (then (call $drop_graph (global.get $g1))))
    (if (global.get $g2) (then (call $drop_graph (global.get $g2))))
    (global.set $c1 (i32.const 0)) (global.set $c2 (i32.const 0))
    (global.set $g1 (i32.const 0)) (global.set $g2 (i32.const 0)))

  ;; Return err(error.data()) after dropping the error and everything held.
  (func $fail (param $error i32) (result i32)
    (call $error_data (local.get $error) (i32.const 48))
    (call $drop_error (local.get $error))
    (call $release)
    (i32.store8 (i32.const 64) (i32.const 1))
    (i32.store (i32.const 68) (i32.load (i32.const 48)))
    (i32.store (i32.const 72) (i32.load (i32.const 52)))
    (i32.const 64))

  (func (export "chain")
        (param $first_ptr i32) (param $first_len i32) (param $second_ptr i32) (param $second_len i32)
        (param $in1_ptr i32) (param $in1_len i32) (param $in2_ptr i32) (param $in2_len i32)
        (param $dims_ptr i32) (param $dims_len i32) (param $data_ptr i32) (param $data_len i32)
        (result i32)
    (local $t i32) (local $named i32) (local $outs i32) (local $n i32) (local $mid i32) (local $last i32)
    ;; graphs
    (call $load_by_name (local.get $first_ptr) (local.get $first_len) (i32.const 0))
    (if (i32.load8_u (i32.const 0)) (then (return (call $fail (i32.load (i32.const 4))))))
    (global.set $g1 (i32.load (i32.const 4)))
    (call $load_by_name (local.get $second_ptr) (local.get $second_len) (i32.const 0))
    (if (i32.load8_u (i32.const 0)) (then (return (call $fail (i32.load (i32.const 4))))))
    (global.set $g2 (i32.load (i32.const 4)))
    ;; contexts
    (call $init_ctx (global.get $g1) (i32.const 0))
    (if (i32.load8_u (i32.const 0)) (then (return (call $fail (i32.load (i32.const 4))))))
    (global.set $c1 (i32.load (i32.const 4)))
    (call $init_ctx (global.get $g2) (i32.const 0))
    (if (i32.load8_u (i32.const 0)) (then (return (call $fail (i32.load (i32.const 4))))))
    (global.set $c2 (i32.load (i32.const 4)))
    ;; the input tensor (FP32 = 1)
    (local.set $t (call $tensor_new (local.get $dims_ptr) (local.get $dims_len) (i32.const 1)
                                    (local.get $data_ptr) (local.get $data_len)))
    ;; first compute: [(first-input, t)]
    (local.set $named (i32.const 16))
    (i32.store (local.get $named) (local.get $in1_ptr))
    (i32.store offset=4 (local.get $named) (local.get $in1_len))
    (i32.store offset=8 (local.get $named) (local.get $t))
    (call $compute (global.get $c1) (local.get $named) (i32.const 1) (i32.const 0))
    (if (i32.load8_u (i32.const 0)) (then (return (call $fail (i32.load (i32.const 4))))))
    (local.set $outs (i32.load (i32.const 4)))
    (local.set $n (i32.load (i32.const 8)))
    (if (i32.eqz (local.get $n)) (then unreachable))
    (local.set $mid (i32.load offset=8 (local.get $outs)))
    (call $drop_outputs (local.get $outs) (local.get $n) (i32.const 0))
    ;; second compute: [(second-input, mid)]: the tensor resource passes straight through
    (i32.store (local.get $named) (local.get $in2_ptr))
    (i32.store offset=4 (local.get $named) (local.get $in2_len))
    (i32.store offset=8 (local.get $named) (local.get $mid))
    (call $compute (global.get $c2) (local.get $named) (i32.const 1) (i32.const 0))
    (if (i32.load8_u (i32.const 0)) (then (return (call $fail (i32.load (i32.const 4))))))
    (local.set $outs (i32.load (i32.const 4)))
    (local.set $n (i32.load (i32.const 8)))
    (if (i32.eqz (local.get $n)) (then unreachable))
    (local.set $last (i32.load offset=8 (local.get $outs)))
    (call $drop_outputs (local.get $outs) (local.get $n) (i32.const 0))
    ;; only the final tensor's bytes enter guest memory
    (call $tensor_data (local.get $last) (i32.const 32))
    (call $drop_tensor (local.get $last))
    (call $release)
    (i32.store8 (i32.const 64) (i32.const 0))
    (i32.store (i32.const 68) (i32.load (i32.const 32)))
    (i32.store (i32.const 72) (i32.load (i32.const 36)))
    (i32.const 64))

  ;; The host has copied the result out: the next call starts with an empty heap.
  (func (export "cabi_post_chain") (param i32)
    (global.set $bump (global.get $heap_base)))
)
