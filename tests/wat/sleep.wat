;; Sleeps through wasi poll_oneoff on one relative monotonic clock of NS nanoseconds
;; (the guest is written out with the number in place of NS), then exits with the
;; errno poll_oneoff returned plus 100 times the number of events it reported.
(module
  (import "wasi_snapshot_preview1" "poll_oneoff"
    (func $poll (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  ;; subscription at 0x100: userdata 7, tag 0 (clock), clock id 1 (monotonic) at 0x110,
  ;; timeout at 0x118, flags at 0x128 (FLAGS: 1 is an absolute time)
  (data (i32.const 0x100) "\07\00\00\00\00\00\00\00")
  (data (i32.const 0x110) "\01\00\00\00")
  (func (export "_start")
    (i64.store (i32.const 0x118) (i64.const NS))
    (i32.store16 (i32.const 0x128) (i32.const FLAGS))
    (call $exit
      (i32.add
        (call $poll (i32.const 0x100) (i32.const 0x200) (i32.const 1) (i32.const 0x300))
        (i32.mul (i32.load (i32.const 0x300)) (i32.const 100))))))
