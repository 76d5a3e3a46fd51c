;; A hand-written component (component text format) that holds descriptors in its scratch
;; directory: tests/components/scratch_unlink.wat plus one export, `leak`, which opens a
;; scratch file again and again and keeps every descriptor. Each is a descriptor of the
;; host process: for tests/test_scratch_descriptors.py, the host must stop the guest past
;; `[guests] max_scratch_open_files`.
;;
;; Exports: those of scratch_unlink.wat (create, unlink, append, close), and
;;   leak(name: string, n: u32) -> u32
;;       open scratch file `name` (create|truncate) `n` times, keeping every descriptor;
;;       returns how many it opened (fewer when an open fails)
(component
  (import "wasinn:nn/scratch@0.1.0" (instance))
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
    (export "[method]descriptor.unlink-file-at"
      (func (param "self" (borrow $descriptor)) (param "path" string)
            (result (result (error $code-e)))))
  ))
  (alias export $fs "descriptor" (type $descriptor-t))
  (import "wasi:filesystem/preopens@0.2.0" (instance $preopens
    (alias outer 1 $descriptor-t (type $d-outer))
    (export "descriptor" (type $d (eq $d-outer)))
    (export "get-directories" (func (result (list (tuple (own $d) string)))))
  ))

  ;; memory: [0, 1 KiB) return areas and constants; [64 KiB, 8 MiB) the bytes that
  ;; `append` writes; from 8 MiB a bump heap that every export call empties again.
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
  )
  (core instance $mem (instantiate $Mem))
  (alias core export $mem "memory" (core memory $memory))
  (alias core export $mem "realloc" (core func $realloc))

  (core func $fs.open-at (canon lower (func $fs "[method]descriptor.open-at") (memory $memory)))
  (core func $fs.write (canon lower (func $fs "[method]descriptor.write") (memory $memory)))
  (core func $fs.unlink (canon lower (func $fs "[method]descriptor.unlink-file-at") (memory $memory)))
  (core func $fs.drop (canon resource.drop $descriptor-t))
  (core func $fs.preopens (canon lower (func $preopens "get-directories") (memory $memory) (realloc $realloc)))

  (core module $Main
    (import "fs" "open-at" (func $fs.open-at (param i32 i32 i32 i32 i32 i32 i32)))
    (import "fs" "write" (func $fs.write (param i32 i32 i32 i64 i32)))
    (import "fs" "unlink" (func $fs.unlink (param i32 i32 i32 i32)))
    (import "fs" "drop" (func $fs.drop (param i32)))
    (import "fs" "preopens" (func $fs.preopens (param i32)))
    (import "mem" "memory" (memory 1))
    (import "mem" "reset" (func $reset))
    (data (i32.const 600) "/.wasinn-scratch")
    (global $data i32 (i32.const 65536))
    (global $dir (mut i32) (i32.const -1))
    (global $file (mut i32) (i32.const -1))
    (global $offset (mut i64) (i64.const 0))

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

    (func $close
      (if (i32.ge_s (global.get $file) (i32.const 0)) (then (call $fs.drop (global.get $file))))
      (global.set $file (i32.const -1))
      (global.set $offset (i64.const 0)))

    ;; open-flags create|truncate, descriptor-flags read|write; the new descriptor or
    ;; -(1 + code)
    (func $open (param $name i32) (param $len i32) (result i32)
      (local $dir i32)
      (local.set $dir (call $scratch-dir))
      (if (i32.lt_s (local.get $dir) (i32.const 0)) (then (return (i32.const -1000))))
      (call $fs.open-at (local.get $dir) (i32.const 0) (local.get $name) (local.get $len)
                        (i32.const 9) (i32.const 3) (i32.const 0))
      (if (i32.load8_u (i32.const 0))
        (then (return (i32.sub (i32.const -1) (i32.load8_u (i32.const 4))))))
      (i32.load (i32.const 4)))

    (func (export "create") (param $name i32) (param $len i32) (result i32)
      (local $fd i32)
      (call $close)
      (local.set $fd (call $open (local.get $name) (local.get $len)))
      (call $reset)
      (if (i32.lt_s (local.get $fd) (i32.const 0))
        (then (return (i32.sub (i32.const 0) (local.get $fd)))))
      (global.set $file (local.get $fd))
      (i32.const 0))

    (func (export "unlink") (param $name i32) (param $len i32) (result i32)
      (local $dir i32) (local $code i32)
      (local.set $dir (call $scratch-dir))
      (if (i32.lt_s (local.get $dir) (i32.const 0)) (then (call $reset) (return (i32.const 1000))))
      (call $fs.unlink (local.get $dir) (local.get $name) (local.get $len) (i32.const 0))
      (if (i32.load8_u (i32.const 0))
        (then (local.set $code (i32.add (i32.load8_u (i32.const 1)) (i32.const 1)))))
      (call $reset)
      (local.get $code))

    (func (export "append") (param $size i32) (param $rounds i32) (result i32)
      (local $i i32)
      (if (i32.lt_s (global.get $file) (i32.const 0)) (then (return (i32.const 1000))))
      ;; not zeros, which a file system may store as holes
      (memory.fill (global.get $data) (i32.const 0x5a) (local.get $size))
      (block $done
        (loop $next
          (br_if $done (i32.ge_u (local.get $i) (local.get $rounds)))
          (call $fs.write (global.get $file) (global.get $data) (local.get $size)
                          (global.get $offset) (i32.const 0))
          (if (i32.load8_u (i32.const 0))
            (then (return (i32.add (i32.load8_u (i32.const 8)) (i32.const 1)))))
          (global.set $offset (i64.add (global.get $offset) (i64.load (i32.const 8))))
          (local.set $i (i32.add (local.get $i) (i32.const 1)))
          (br $next)))
      (i32.const 0))

    (func (export "close") (result i32) (call $close) (i32.const 0))
    ;; open scratch file `name` n times, keeping every descriptor; the number opened
    (func (export "leak") (param $name i32) (param $len i32) (param $n i32) (result i32)
      (local $i i32) (local $fd i32)
      (block $done
        (loop $next
          (br_if $done (i32.ge_u (local.get $i) (local.get $n)))
          (local.set $fd (call $open (local.get $name) (local.get $len)))
          (br_if $done (i32.lt_s (local.get $fd) (i32.const 0)))
          (local.set $i (i32.add (local.get $i) (i32.const 1)))
          (br $next)))
      (call $reset)
      (local.get $i))
  )
  (core instance $main (instantiate $Main
    (with "mem" (instance $mem))
    (with "fs" (instance
      (export "open-at" (func $fs.open-at))
      (export "write" (func $fs.write))
      (export "unlink" (func $fs.unlink))
      (export "drop" (func $fs.drop))
      (export "preopens" (func $fs.preopens))
    ))
  ))

  (func (export "leak") (param "name" string) (param "n" u32) (result u32)
    (canon lift (core func $main "leak") (memory $memory) (realloc $realloc)))
  (func (export "create") (param "name" string) (result u32)
    (canon lift (core func $main "create") (memory $memory) (realloc $realloc)))
  (func (export "unlink") (param "name" string) (result u32)
    (canon lift (core func $main "unlink") (memory $memory) (realloc $realloc)))
  (func (export "append") (param "size" u32) (param "rounds" u32) (result u32)
    (canon lift (core func $main "append")))
  (func (export "close") (result u32) (canon lift (core func $main "close")))
)
