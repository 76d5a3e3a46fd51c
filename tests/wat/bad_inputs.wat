;; Every kind of bad argument a guest can pass to wasi_ephemeral_nn, each checked for its
;; errno. Exits 0 when every check holds, else with the number of the first failed check
;; (the `;; #N` comments). Needs the registered models "identity" (f32 (n, 4) -> y = x)
;; and "missing" (a registered name whose file does not exist).
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (import "wasi_ephemeral_nn" "load" (func $load (param i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "load_by_name" (func $load_by_name (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "load_by_name_with_config"
    (func $load_by_name_with_config (param i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "init_execution_context" (func $init (param i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "set_input" (func $set_input (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "set_input_by_name"
    (func $set_input_by_name (param i32 i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "compute" (func $compute (param i32) (result i32)))
  (import "wasi_ephemeral_nn" "get_output" (func $get_output (param i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "get_output_by_name"
    (func $get_output_by_name (param i32 i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "unload" (func $unload (param i32) (result i32)))
  (import "wasi_ephemeral_nn" "finalize_execution_context" (func $finalize (param i32) (result i32)))
  (memory (export "memory") 1)

  (data (i32.const 0x100) "identity")
  (data (i32.const 0x110) "missing")
  (data (i32.const 0x120) "nope")
  (data (i32.const 0x130) "\ff\fe")
  (data (i32.const 0x140) "x")
  (data (i32.const 0x144) "y")
  (data (i32.const 0x150) "{\"n_gpu_layers\": 0}")
  (data (i32.const 0x800) "not a model at all")

  (func $expect (param $tag i32) (param $got i32) (param $want i32)
    (if (i32.ne (local.get $got) (local.get $want))
      (then (call $proc_exit (local.get $tag)))))

  ;; A 20-byte tensor record at $at.
  (func $record (param $at i32) (param $dims i32) (param $rank i32) (param $type i32)
                (param $data i32) (param $len i32)
    (i32.store (local.get $at) (local.get $dims))
    (i32.store offset=4 (local.get $at) (local.get $rank))
    (i32.store offset=8 (local.get $at) (local.get $type))
    (i32.store offset=12 (local.get $at) (local.get $data))
    (i32.store offset=16 (local.get $at) (local.get $len)))

  (func (export "_start")
    (local $g i32) (local $c i32)
    ;; dims [1, 4] at 0x200, absurd dims at 0x220, f32 data 1..4 at 0x300
    (i32.store (i32.const 0x200) (i32.const 1))
    (i32.store (i32.const 0x204) (i32.const 4))
    (i32.store (i32.const 0x220) (i32.const 65536))
    (i32.store (i32.const 0x224) (i32.const 65536))
    (i32.store (i32.const 0x228) (i32.const 65536))
    (i32.store (i32.const 0x22c) (i32.const 65536))
    (f32.store (i32.const 0x300) (f32.const 1))
    (f32.store (i32.const 0x304) (f32.const 2))
    (f32.store (i32.const 0x308) (f32.const 3))
    (f32.store (i32.const 0x30c) (f32.const 4))
    ;; the good record: f32 with garbage in the padding bytes, as real guests send it
    (call $record (i32.const 0x400) (i32.const 0x200) (i32.const 2) (i32.const 0x00100301)
                  (i32.const 0x300) (i32.const 16))
    (call $record (i32.const 0x420) (i32.const 0x200) (i32.const 33) (i32.const 1)
                  (i32.const 0x300) (i32.const 16))
    (call $record (i32.const 0x440) (i32.const 0x220) (i32.const 4) (i32.const 1)
                  (i32.const 0x300) (i32.const 16))
    (call $record (i32.const 0x460) (i32.const 0x200) (i32.const 2) (i32.const 1)
                  (i32.const 0xfffffff0) (i32.const 16))
    (call $record (i32.const 0x480) (i32.const 0xfffffffc) (i32.const 2) (i32.const 1)
                  (i32.const 0x300) (i32.const 16))
    (call $record (i32.const 0x4a0) (i32.const 0x200) (i32.const 2) (i32.const 9)
                  (i32.const 0x300) (i32.const 16))
    (call $record (i32.const 0x4c0) (i32.const 0x200) (i32.const 2) (i32.const 1)
                  (i32.const 0x300) (i32.const 12))
    ;; builders: one good-looking pair -> garbage bytes; one pair far out of memory
    (i32.store (i32.const 0x700) (i32.const 0x800))
    (i32.store (i32.const 0x704) (i32.const 18))
    (i32.store (i32.const 0x708) (i32.const 0x7ffffff0))
    (i32.store (i32.const 0x70c) (i32.const 64))

    ;; ---- load / load_by_name -------------------------------------------------------
    (call $expect (i32.const 1) (call $load_by_name (i32.const 0xfffffff0) (i32.const 16) (i32.const 0x500)) (i32.const 1)) ;; #1 name out of memory
    (call $expect (i32.const 2) (call $load_by_name (i32.const 0x100) (i32.const -1) (i32.const 0x500)) (i32.const 1)) ;; #2 length >= 2 GiB
    (call $expect (i32.const 3) (call $load_by_name (i32.const 0x130) (i32.const 2) (i32.const 0x500)) (i32.const 1)) ;; #3 not UTF-8
    (call $expect (i32.const 4) (call $load_by_name (i32.const 0x120) (i32.const 4) (i32.const 0x500)) (i32.const 8)) ;; #4 unknown name
    (call $expect (i32.const 5) (call $load_by_name (i32.const 0x110) (i32.const 7) (i32.const 0x500)) (i32.const 103)) ;; #5 file missing
    (call $expect (i32.const 6) (call $load_by_name (i32.const 0x100) (i32.const 8) (i32.const 0x10000)) (i32.const 1)) ;; #6 result out of memory
    (call $expect (i32.const 7) (call $load (i32.const 0x700) (i32.const 1) (i32.const 42) (i32.const 0) (i32.const 0x500)) (i32.const 2)) ;; #7 unknown encoding
    (call $expect (i32.const 8) (call $load (i32.const 0x700) (i32.const 1) (i32.const 9) (i32.const 0) (i32.const 0x500)) (i32.const 6)) ;; #8 WasmEdge's whisper
    (call $expect (i32.const 9) (call $load (i32.const 0x700) (i32.const 1) (i32.const 1) (i32.const 7) (i32.const 0x500)) (i32.const 1)) ;; #9 unknown target
    (call $expect (i32.const 10) (call $load (i32.const 0x700) (i32.const 2) (i32.const 1) (i32.const 0) (i32.const 0x500)) (i32.const 1)) ;; #10 builder out of memory
    (call $expect (i32.const 11) (call $load (i32.const 0x700) (i32.const 0x40000000) (i32.const 1) (i32.const 0) (i32.const 0x500)) (i32.const 1)) ;; #11 absurd builder count
    (call $expect (i32.const 12) (call $load (i32.const 0x700) (i32.const 1) (i32.const 1) (i32.const 0) (i32.const 0x500)) (i32.const 2)) ;; #12 garbage model bytes
    (call $expect (i32.const 13) (call $load_by_name_with_config (i32.const 0x100) (i32.const 8) (i32.const 0x150) (i32.const 19) (i32.const 0x500)) (i32.const 0)) ;; #13
    (call $expect (i32.const 14) (call $unload (i32.load (i32.const 0x500))) (i32.const 0)) ;; #14
    (call $expect (i32.const 15) (call $load_by_name (i32.const 0x100) (i32.const 8) (i32.const 0x500)) (i32.const 0)) ;; #15
    (local.set $g (i32.load (i32.const 0x500)))

    ;; ---- contexts ------------------------------------------------------------------
    (call $expect (i32.const 20) (call $init (i32.const 99) (i32.const 0x504)) (i32.const 8)) ;; #20 unknown graph
    (call $expect (i32.const 21) (call $init (local.get $g) (i32.const -4)) (i32.const 1)) ;; #21 result out of memory
    (call $expect (i32.const 22) (call $init (local.get $g) (i32.const 0x504)) (i32.const 0)) ;; #22
    (local.set $c (i32.load (i32.const 0x504)))

    ;; ---- inputs ----------------------------------------------------------------------
    (call $expect (i32.const 30) (call $set_input (local.get $c) (i32.const 0) (i32.const 0xffffffec)) (i32.const 1)) ;; #30 record out of memory
    (call $expect (i32.const 31) (call $set_input (local.get $c) (i32.const 0) (i32.const 0x420)) (i32.const 1)) ;; #31 rank 33
    (call $expect (i32.const 32) (call $set_input (local.get $c) (i32.const 0) (i32.const 0x440)) (i32.const 1)) ;; #32 absurd dimensions
    (call $expect (i32.const 33) (call $set_input (local.get $c) (i32.const 0) (i32.const 0x460)) (i32.const 1)) ;; #33 data out of memory
    (call $expect (i32.const 34) (call $set_input (local.get $c) (i32.const 0) (i32.const 0x480)) (i32.const 1)) ;; #34 dims out of memory
    (call $expect (i32.const 35) (call $set_input (local.get $c) (i32.const 0) (i32.const 0x4a0)) (i32.const 1)) ;; #35 unknown type
    (call $expect (i32.const 36) (call $set_input (local.get $c) (i32.const 0) (i32.const 0x4c0)) (i32.const 1)) ;; #36 length mismatch
    (call $expect (i32.const 37) (call $set_input (local.get $c) (i32.const 5) (i32.const 0x400)) (i32.const 8)) ;; #37 no input 5
    (call $expect (i32.const 38) (call $set_input (i32.const 1234) (i32.const 0) (i32.const 0x400)) (i32.const 8)) ;; #38 unknown context
    (call $expect (i32.const 39) (call $set_input_by_name (local.get $c) (i32.const 0x120) (i32.const 4) (i32.const 0x400)) (i32.const 8)) ;; #39 no input "nope"
    (call $expect (i32.const 40) (call $set_input_by_name (local.get $c) (i32.const 0x130) (i32.const 2) (i32.const 0x400)) (i32.const 1)) ;; #40 name not UTF-8
    (call $expect (i32.const 41) (call $get_output (local.get $c) (i32.const 0) (i32.const 0x600) (i32.const 64) (i32.const 0x508)) (i32.const 1)) ;; #41 before compute
    (call $expect (i32.const 42) (call $set_input (local.get $c) (i32.const 0) (i32.const 0x400)) (i32.const 0)) ;; #42

    ;; ---- compute and outputs ---------------------------------------------------------------
    (call $expect (i32.const 50) (call $compute (i32.const 77)) (i32.const 8)) ;; #50 unknown context
    (call $expect (i32.const 51) (call $compute (local.get $c)) (i32.const 0)) ;; #51
    (call $expect (i32.const 52) (call $get_output (local.get $c) (i32.const 0) (i32.const 0x600) (i32.const 8) (i32.const 0x508)) (i32.const 7)) ;; #52 too small
    (call $expect (i32.const 53) (i32.load (i32.const 0x508)) (i32.const 16)) ;; #53 needed size written
    (call $expect (i32.const 54) (call $get_output (local.get $c) (i32.const 0) (i32.const 0xfffffff0) (i32.const 64) (i32.const 0x508)) (i32.const 1)) ;; #54 buffer out of memory
    (call $expect (i32.const 55) (call $get_output (local.get $c) (i32.const 0) (i32.const 0x600) (i32.const 64) (i32.const 0x10000)) (i32.const 1)) ;; #55 written out of memory
    (call $expect (i32.const 56) (call $get_output (local.get $c) (i32.const 3) (i32.const 0x600) (i32.const 64) (i32.const 0x508)) (i32.const 8)) ;; #56 no output 3
    (call $expect (i32.const 57) (call $get_output (local.get $c) (i32.const 0) (i32.const 0x600) (i32.const 64) (i32.const 0x508)) (i32.const 0)) ;; #57
    (call $expect (i32.const 58) (i32.load (i32.const 0x508)) (i32.const 16)) ;; #58
    (call $expect (i32.const 59) (i32.trunc_f32_s (f32.load (i32.const 0x60c))) (i32.const 4)) ;; #59 y = x
    (call $expect (i32.const 60) (call $get_output_by_name (local.get $c) (i32.const 0x144) (i32.const 1) (i32.const 0x610) (i32.const 16) (i32.const 0x508)) (i32.const 0)) ;; #60
    (call $expect (i32.const 61) (i32.trunc_f32_s (f32.load (i32.const 0x614))) (i32.const 2)) ;; #61
    (call $expect (i32.const 62) (call $get_output_by_name (local.get $c) (i32.const 0x140) (i32.const 1) (i32.const 0x610) (i32.const 16) (i32.const 0x508)) (i32.const 8)) ;; #62 "x" is no output

    ;; ---- closing -------------------------------------------------------------------------
    (call $expect (i32.const 70) (call $finalize (local.get $c)) (i32.const 0)) ;; #70
    (call $expect (i32.const 71) (call $compute (local.get $c)) (i32.const 8)) ;; #71 after finalize
    (call $expect (i32.const 72) (call $finalize (local.get $c)) (i32.const 8)) ;; #72 twice
    (call $expect (i32.const 73) (call $init (local.get $g) (i32.const 0x504)) (i32.const 0)) ;; #73
    (local.set $c (i32.load (i32.const 0x504)))
    (call $expect (i32.const 74) (call $unload (local.get $g)) (i32.const 0)) ;; #74
    (call $expect (i32.const 75) (call $set_input (local.get $c) (i32.const 0) (i32.const 0x400)) (i32.const 8)) ;; #75 context of an unloaded graph
    (call $expect (i32.const 76) (call $init (local.get $g) (i32.const 0x504)) (i32.const 8)) ;; #76 unloaded graph
    (call $expect (i32.const 77) (call $unload (local.get $g)) (i32.const 8)) ;; #77 twice
  )
)
