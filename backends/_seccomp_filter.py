"""The seccomp filter a confined process gives itself (see :mod:`._confine`): which
system calls fail with EPERM, and those allowed on the process itself only, as a classic
BPF program for x86-64.

Plain data and one function, with no import of wasinn: a confined child loads this
module from its file, as it loads :mod:`._confine`, before it may import anything that
starts a thread.
"""

from __future__ import annotations

import errno
import os
import struct

_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_LD_ABS_W = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET = 0x06  # BPF_RET | BPF_K
_CLONE_THREAD = 0x00010000
#: CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET.
_CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 \
    | 0x20000000 | 0x40000000
_NR_CLONE = 56
_NR_CLONE3 = 435
#: Stands for the process's own pid in :data:`ON_ITSELF_X86_64`.
_ITSELF = -1
#: x86-64 system calls allowed only on the process itself: name -> (number, checks),
#: each check (argument index, the values it may take). 0 is the caller (a pid, a
#: ``who``); ``_ITSELF`` the process's pid (its main thread, or all of it).
ON_ITSELF_X86_64: dict[str, tuple[int, tuple[tuple[int, tuple[int, ...]], ...]]] = {
    "prlimit64": (302, ((0, (0, _ITSELF)),)),
    "setpriority": (141, ((0, (0,)), (1, (0, _ITSELF)))),  # PRIO_PROCESS only
    "ioprio_set": (251, ((0, (1,)), (1, (0, _ITSELF)))),  # IOPRIO_WHO_PROCESS only
    "sched_setaffinity": (203, ((0, (0, _ITSELF)),)),
    "sched_setscheduler": (144, ((0, (0, _ITSELF)),)),
    "sched_setparam": (142, ((0, (0, _ITSELF)),)),
    "sched_setattr": (314, ((0, (0, _ITSELF)),)),
    "kill": (62, ((0, (_ITSELF,)),)),
    "tgkill": (234, ((0, (_ITSELF,)),)),
    "rt_sigqueueinfo": (129, ((0, (_ITSELF,)),)),
    "rt_tgsigqueueinfo": (297, ((0, (_ITSELF,)),)),
}
#: x86-64 system calls that fail with EPERM.
DENIED_X86_64 = {
    "execve": 59, "execveat": 322, "fork": 57, "vfork": 58,
    "socket": 41, "socketpair": 53, "connect": 42, "bind": 49, "listen": 50,
    "accept": 43, "accept4": 288,
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438,
    "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "mount_setattr": 442,
    "setns": 308, "unshare": 272,
    "keyctl": 250, "add_key": 248, "request_key": 249,
    "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "tkill": 200, "pidfd_open": 434, "pidfd_send_signal": 424, "process_madvise": 440,
    "kcmp": 312, "reboot": 169, "kexec_load": 246, "kexec_file_load": 320,
    "init_module": 175, "finit_module": 313, "delete_module": 176,
    "swapon": 167, "swapoff": 168, "acct": 163, "quotactl": 179, "quotactl_fd": 443,
    "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159,
    "sethostname": 170, "setdomainname": 171, "iopl": 172, "ioperm": 173,
    "syslog": 103, "vhangup": 153, "name_to_handle_at": 303, "open_by_handle_at": 304,
    "fanotify_init": 300, "lookup_dcookie": 212,
}


def seccomp_program() -> bytes:
    """The x86-64 deny-list filter, as ``struct sock_filter`` instructions, for this
    process: the calls that act on a process are allowed on it only (see
    :data:`ON_ITSELF_X86_64`)."""
    pid = os.getpid()

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    eperm = _RET_ERRNO | errno.EPERM
    prog = [
        op(_LD_ABS_W, 4),  # seccomp_data.arch
        op(_JEQ, _AUDIT_ARCH_X86_64, 1, 0),
        op(_RET, eperm),  # i386 calls (int 0x80) would bypass the numbers below
        op(_LD_ABS_W, 0),  # seccomp_data.nr
        op(_JGE, _X32_SYSCALL_BIT, 0, 1),
        op(_RET, eperm),  # x32 calls likewise
        op(_JEQ, _NR_CLONE3, 0, 1),
        op(_RET, _RET_ERRNO | errno.ENOSYS),
        op(_JEQ, _NR_CLONE, 0, 5),
        op(_LD_ABS_W, 16),  # the low half of args[0], the flags
        op(_JSET, _CLONE_NAMESPACES, 2, 0),
        op(_JSET, _CLONE_THREAD, 0, 1),
        op(_RET, _RET_ALLOW),  # a thread
        op(_RET, eperm),  # a process
    ]
    for number, checks in ON_ITSELF_X86_64.values():
        # Allowed when each checked argument's low 32 bits are one of its values (a pid
        # is an int: its upper bits may be a sign's), else EPERM.
        block: list[bytes] = []
        for arg, values in checks:
            allowed = tuple(pid if v is _ITSELF else v for v in values)
            block.append(op(_LD_ABS_W, 16 + 8 * arg))  # seccomp_data.args[arg], low half
            for i, value in enumerate(allowed):  # on a match: the next check
                block.append(op(_JEQ, value, len(allowed) - i, 0))
            block.append(op(_RET, eperm))
        block.append(op(_RET, _RET_ALLOW))
        prog += [op(_JEQ, number, 0, len(block)), *block]
    for number in sorted(DENIED_X86_64.values()):
        prog += [op(_JEQ, number, 0, 1), op(_RET, eperm)]
    prog.append(op(_RET, _RET_ALLOW))
    return b"".join(prog)
