;; Loads the model registered as "affine" (y = 2x + 1 over f32[n, 4]) by name and runs it
;; once on x = [[1, 2, 3, 4]] through a context: exit status 0 when y = [[3, 5, 7, 9]],
;; else the step that failed (1 load_by_name, 2 init_execution_context, 3 set_input,
;; 4 compute, 5 get_output, 6 a wrong output).
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (import "wasi_ephemeral_nn" "load_by_name" (func $load_by_name (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "init_execution_context" (func $init (param i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "set_input" (func $set_input (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "compute" (func $compute (param i32) (result i32)))
  (import "wasi_ephemeral_nn" "get_output" (func $get_output (param i32 i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0) "affine")
  ;; 16: the graph handle, 20: the context handle
  (data (i32.const 32) "\01\00\00\00\04\00\00\00")  ;; dims [1, 4]
  ;; the tensor record (20 bytes): dims at 32 (rank 2), type f32 (1), data at 80 (16 bytes)
  (data (i32.const 48) "\20\00\00\00\02\00\00\00\01\00\00\00\50\00\00\00\10\00\00\00")
  (data (i32.const 80) "\00\00\80\3f\00\00\00\40\00\00\40\40\00\00\80\40")  ;; 1, 2, 3, 4
  ;; 96: the output (16 bytes), 128: its size

  (func $check (param $errno i32) (param $step i32)
    (if (local.get $errno) (then (call $proc_exit (local.get $step)))))

  (func (export "_start")
    (call $check (call $load_by_name (i32.const 0) (i32.const 6) (i32.const 16)) (i32.const 1))
    (call $check (call $init (i32.load (i32.const 16)) (i32.const 20)) (i32.const 2))
    (call $check (call $set_input (i32.load (i32.const 20)) (i32.const 0) (i32.const 48))
                 (i32.const 3))
    (call $check (call $compute (i32.load (i32.const 20))) (i32.const 4))
    (call $check (call $get_output (i32.load (i32.const 20)) (i32.const 0) (i32.const 96)
                                   (i32.const 16) (i32.const 128))
                 (i32.const 5))
    (if (i32.or (f32.ne (f32.load (i32.const 96)) (f32.const 3))
                (f32.ne (f32.load (i32.const 108)) (f32.const 9)))
      (then (call $proc_exit (i32.const 6))))))
