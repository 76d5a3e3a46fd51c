;; A hand-written component (component text format) that nests folders in its scratch
;; directory: `depth` times, it makes folder `d` (wasi:filesystem `create-directory-at`)
;; in the folder it last made and opens it (`open-at`) to go on in there, so the folders
;; are `d/d/d/...`, one entry each. For tests/test_component_scratch.py: closing the
;; guest must remove its directory however deep it goes (a recursive removal met
;; Python's recursion limit at about 1,000 levels).
;;
;; It imports `wasinn:nn/scratch` (an empty instance) only so that the host gives it a
;; scratch directory; it calls nothing in it.
;;
;; Exports:
;;   nest(depth: u32) -> u32   0, 1 + the wasi:filesystem error-code of the first call
;;                             that failed, or 1000 when there is no /.wasinn-scratch
;;                             preopen; it keeps no descriptor but the preopen's
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
    (export "[method]descriptor.create-directory-at"
      (func (param "self" (borrow $descriptor)) (param "path" string)
            (result (result (error $code-e)))))
  ))
  (alias export $fs "descriptor" (type $descriptor-t))
  (import "wasi:filesystem/preopens@0.2.0" (instance $preopens
    (alias outer 1 $descriptor-t (type $d-outer))
    (export "descriptor" (type $d (eq $d-outer)))
    (export "get-directories" (func (result (list (tuple (own $d) string)))))
  ))

  ;; memory: [0, 1 KiB) return areas and constants; from 64 KiB a bump heap (only the
  ;; preopens' list, once).
  (core module $Mem
    (memory (export "memory") 2)
    (global $bump (mut i32) (i32.const 65536))
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
  )
  (core instance $mem (instantiate $Mem))
  (alias core export $mem "memory" (core memory $memory))
  (alias core export $mem "realloc" (core func $realloc))

  (core func $fs.open-at (canon lower (func $fs "[method]descriptor.open-at") (memory $memory)))
  (core func $fs.mkdir (canon lower (func $fs "[method]descriptor.create-directory-at") (memory $memory)))
  (core func $fs.drop (canon resource.drop $descriptor-t))
  (core func $fs.preopens (canon lower (func $preopens "get-directories") (memory $memory) (realloc $realloc)))

  (core module $Main
    (import "fs" "open-at" (func $fs.open-at (param i32 i32 i32 i32 i32 i32 i32)))
    (import "fs" "mkdir" (func $fs.mkdir (param i32 i32 i32 i32)))
    (import "fs" "drop" (func $fs.drop (param i32)))
    (import "fs" "preopens" (func $fs.preopens (param i32)))
    (import "mem" "memory" (memory 1))
    (data (i32.const 600) "/.wasinn-scratch")
    (data (i32.const 620) "d")
    (global $dir (mut i32) (i32.const -1))

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

    (func (export "nest") (param $depth i32) (result i32)
      (local $at i32) (local $k i32) (local $code i32)
      (local.set $at (call $scratch-dir))
      (if (i32.lt_s (local.get $at) (i32.const 0)) (then (return (i32.const 1000))))
      (block $done
        (loop $level
          (br_if $done (i32.ge_u (local.get $k) (local.get $depth)))
          (call $fs.mkdir (local.get $at) (i32.const 620) (i32.const 1) (i32.const 0))
          (if (i32.load8_u (i32.const 0))
            (then (local.set $code (i32.add (i32.load8_u (i32.const 1)) (i32.const 1)))
                  (br $done)))
          ;; open-flags directory, descriptor-flags read|mutate-directory
          (call $fs.open-at (local.get $at) (i32.const 0) (i32.const 620) (i32.const 1)
                            (i32.const 2) (i32.const 33) (i32.const 0))
          (if (i32.load8_u (i32.const 0))
            (then (local.set $code (i32.add (i32.load8_u (i32.const 4)) (i32.const 1)))
                  (br $done)))
          (if (i32.ne (local.get $at) (global.get $dir)) (then (call $fs.drop (local.get $at))))
          (local.set $at (i32.load (i32.const 4)))
          (local.set $k (i32.add (local.get $k) (i32.const 1)))
          (br $level)))
      (if (i32.ne (local.get $at) (global.get $dir)) (then (call $fs.drop (local.get $at))))
      (local.get $code))
  )
  (core instance $main (instantiate $Main
    (with "mem" (instance $mem))
    (with "fs" (instance
      (export "open-at" (func $fs.open-at))
      (export "mkdir" (func $fs.mkdir))
      (export "drop" (func $fs.drop))
      (export "preopens" (func $fs.preopens))
    ))
  ))

  (func (export "nest") (param "depth" u32) (result u32) (canon lift (core func $main "nest")))
)
