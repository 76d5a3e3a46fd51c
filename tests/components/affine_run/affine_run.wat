;; Core module of the affine-run command (world `affine-run` in world.wit), written by
;; hand in WAT; `wasm-tools component embed` + `component new` make it a component.
;;
;; Canonical ABI shapes used here (wasi:nn 2024-10-28):
;;   result<own<R>, own<error>>  -> retptr: [disc u8 @0][handle i32 @4]
;;   result<list<T>, own<error>> -> retptr: [disc u8 @0][ptr i32 @4][len i32 @8 | error @4]
;;   named-tensor                -> [name ptr i32][name len i32][tensor handle i32], 12 bytes
;; A handle the call fails to get is not dropped: the host releases what the guest holds.
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

  (memory (export "memory") 1)
  ;; 0..15: the return area of every call
  (data (i32.const 16) "affine")
  (data (i32.const 24) "x")
  (data (i32.const 32) "\01\00\00\00\04\00\00\00")  ;; dims [1, 4]
  (data (i32.const 48) "\00\00\80\3f\00\00\00\40\00\00\40\40\00\00\80\40")  ;; 1, 2, 3, 4
  ;; 64: the named-tensor list of the compute; the host's lists from 1024 on
  (global $bump (mut i32) (i32.const 1024))

  (func (export "cabi_realloc") (param $old i32) (param $old_size i32) (param $align i32)
        (param $size i32) (result i32)
    (local $p i32)
    (local.set $p (i32.and (i32.add (global.get $bump) (i32.sub (local.get $align) (i32.const 1)))
                           (i32.sub (i32.const 0) (local.get $align))))
    (global.set $bump (i32.add (local.get $p) (local.get $size)))
    (if (i32.gt_u (global.get $bump) (i32.const 65536)) (then unreachable))
    (if (local.get $old_size)
      (then (memory.copy (local.get $p) (local.get $old) (local.get $old_size))))
    (local.get $p))

  (func (export "wasi:cli/run@0.2.0#run") (result i32)
    (local $graph i32) (local $ctx i32) (local $y i32) (local $data i32)
    (call $load_by_name (i32.const 16) (i32.const 6) (i32.const 0))
    (if (i32.load8_u (i32.const 0)) (then (return (i32.const 1))))
    (local.set $graph (i32.load (i32.const 4)))
    (call $init_ctx (local.get $graph) (i32.const 0))
    (if (i32.load8_u (i32.const 0)) (then (return (i32.const 1))))
    (local.set $ctx (i32.load (i32.const 4)))
    ;; [("x", tensor(FP32 = 1, [1, 4], data))]
    (i32.store (i32.const 64) (i32.const 24))
    (i32.store (i32.const 68) (i32.const 1))
    (i32.store (i32.const 72) (call $tensor_new (i32.const 32) (i32.const 2) (i32.const 1)
                                                (i32.const 48) (i32.const 16)))
    (call $compute (local.get $ctx) (i32.const 64) (i32.const 1) (i32.const 0))
    (if (i32.load8_u (i32.const 0)) (then (return (i32.const 1))))
    (if (i32.ne (i32.load (i32.const 8)) (i32.const 1)) (then (return (i32.const 1))))
    (local.set $y (i32.load offset=8 (i32.load (i32.const 4))))
    (call $tensor_data (local.get $y) (i32.const 0))
    (local.set $data (i32.load (i32.const 0)))
    (call $drop_tensor (local.get $y))
    (call $drop_ctx (local.get $ctx))
    (call $drop_graph (local.get $graph))
    (if (i32.or (i32.ne (i32.load (i32.const 4)) (i32.const 16))
                (i32.or (f32.ne (f32.load (local.get $data)) (f32.const 3))
                        (f32.ne (f32.load offset=12 (local.get $data)) (f32.const 9))))
      (then (return (i32.const 1))))
    (i32.const 0)))
