;; Loads the model registered as "loop" (tests/loop_model.py: y = x + m by an ONNX Loop of
;; m iterations) by name and runs it once with m = 2,000,000,000 (the most OpenVINO, which
;; computes i64 as i32, takes: minutes of work) and x = zeros(1, 4): a compute that runs
;; long and that its backend does not stop when cancelled. Exit status 0 when the compute
;; returned, else the step that failed (1 load_by_name, 2 init_execution_context,
;; 3 set_input m, 4 set_input x, 5 compute).
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (import "wasi_ephemeral_nn" "load_by_name" (func $load_by_name (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "init_execution_context" (func $init (param i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "set_input" (func $set_input (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "compute" (func $compute (param i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0) "loop")
  ;; 16: the graph handle, 20: the context handle
  (data (i32.const 32) "\01\00\00\00")                  ;; m's dims [1]
  (data (i32.const 36) "\01\00\00\00\04\00\00\00")      ;; x's dims [1, 4]
  ;; the tensor records (20 bytes each): dims, rank, type, data, data's length
  ;; m: dims at 32 (rank 1), type i64 (5), data at 128 (8 bytes)
  (data (i32.const 48) "\20\00\00\00\01\00\00\00\05\00\00\00\80\00\00\00\08\00\00\00")
  ;; x: dims at 36 (rank 2), type f32 (1), data at 144 (16 bytes of zeros)
  (data (i32.const 68) "\24\00\00\00\02\00\00\00\01\00\00\00\90\00\00\00\10\00\00\00")

  (func $check (param $errno i32) (param $step i32)
    (if (local.get $errno) (then (call $proc_exit (local.get $step)))))

  (func (export "_start")
    (i64.store (i32.const 128) (i64.const 2000000000))
    (call $check (call $load_by_name (i32.const 0) (i32.const 4) (i32.const 16)) (i32.const 1))
    (call $check (call $init (i32.load (i32.const 16)) (i32.const 20)) (i32.const 2))
    (call $check (call $set_input (i32.load (i32.const 20)) (i32.const 0) (i32.const 48))
                 (i32.const 3))
    (call $check (call $set_input (i32.load (i32.const 20)) (i32.const 1) (i32.const 68))
                 (i32.const 4))
    (call $check (call $compute (i32.load (i32.const 20))) (i32.const 5))))
