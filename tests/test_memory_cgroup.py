"""The memory bounds honour the limit of the cgroup this process is in (a container's, a
systemd slice's): :mod:`wasinn._cgroup` reads it from fake ``/proc`` and ``/sys`` trees
(cgroup v2 nested and in a container's namespace, v1, none, garbage), and
``available_memory``, ``total_memory``, ``default_max_bytes`` and
``default_max_processes`` take it where it is lower than the machine's memory."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import psutil
import pytest

from wasinn import TensorType, TooLargeError, _cgroup
from wasinn._cgroup import CgroupMemory, cgroup_memory
from wasinn._memory import available_memory, total_memory
from wasinn.backends import TensorSpec
from wasinn.backends._sandbox_limit import (
    LEAST_DEFAULT,
    MEMORY_PER_PROCESS,
    PROCESSES_PER_CPU,
    default_max_processes,
)
from wasinn.backends.sandbox import default_max_bytes
from wasinn.scheduler.warmup import zero_inputs

MiB, GiB = 1 << 20, 1 << 30
V1_UNLIMITED = "9223372036854771712"  # what v1 writes for no limit (2**63 less a page)
V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"


def v1_mount(root: str, point: str = "/sys/fs/cgroup/memory") -> str:
    return f"35 31 0:32 {root} {point} rw,relatime - cgroup cgroup rw,memory"


def fake_tree(root: Path, cgroup: str | None, mountinfo: str | None,
              files: Mapping[str, str | bytes]) -> Path:
    """A filesystem root holding ``/proc/self/cgroup``, ``/proc/self/mountinfo`` (None:
    not there) and ``files`` (paths relative to the root: text, or bytes as they are)."""
    for path, text in {"proc/self/cgroup": cgroup, "proc/self/mountinfo": mountinfo,
                       **files}.items():
        if text is None:
            continue
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            (root / path).write_bytes(text)
        else:
            (root / path).write_text(text)
    return root


def v2_nested(root: Path) -> Path:
    """A service's cgroup whose memory.max is "max", in a slice limited to 2 GiB that
    holds 1.5 GiB (256 MiB of it inactive file cache), under a real root (no
    memory.max)."""
    slice_, service = "sys/fs/cgroup/system.slice", "sys/fs/cgroup/system.slice/wasinn.service"
    return fake_tree(root, "0::/system.slice/wasinn.service\n", V2_MOUNT + "\n", {
        "sys/fs/cgroup/cgroup.controllers": "cpu memory pids\n",
        "sys/fs/cgroup/memory.stat": "inactive_file 999999999\n",
        f"{slice_}/memory.max": f"{2 * GiB}\n",
        f"{slice_}/memory.current": f"{3 * GiB // 2}\n",
        f"{slice_}/memory.stat": f"anon 1\nactive_file 7\ninactive_file {256 * MiB}\n",
        f"{service}/memory.max": "max\n",
        f"{service}/memory.current": f"{100 * MiB}\n",
        f"{service}/memory.stat": f"inactive_file {10 * MiB}\n",
    })


def v2_container(root: Path, mountinfo: str | None = V2_MOUNT + "\n") -> Path:
    """Inside a container's cgroup namespace: ``0::/``, and /sys/fs/cgroup is the
    container's own cgroup, limited to 1 GiB and holding 300 MiB (100 MiB inactive)."""
    return fake_tree(root, "0::/\n", mountinfo, {
        "sys/fs/cgroup/cgroup.controllers": "cpu memory\n",
        "sys/fs/cgroup/memory.max": f"{GiB}\n",
        "sys/fs/cgroup/memory.current": f"{300 * MiB}\n",
        "sys/fs/cgroup/memory.stat": f"file 5\ninactive_file {100 * MiB}\nactive_file 3\n",
    })


def v1_docker(root: Path, hierarchical: str = V1_UNLIMITED) -> Path:
    """cgroup v1, a Docker container without a cgroup namespace: its memory cgroup
    /docker/abc mounted at /sys/fs/cgroup/memory, limited to 512 MiB and holding
    200 MiB (50 MiB inactive file cache, counted with its children's)."""
    return fake_tree(root, "12:pids:/docker/abc\n4:memory:/docker/abc\n1:name=systemd:/\n0::/\n",
                     v1_mount("/docker/abc") + "\n" + V2_MOUNT.replace(
                         "/sys/fs/cgroup", "/sys/fs/cgroup/unified") + "\n", {
        "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{512 * MiB}\n",
        "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{200 * MiB}\n",
        "sys/fs/cgroup/memory/memory.stat": (
            f"inactive_file {10 * MiB}\nhierarchical_memory_limit {hierarchical}\n"
            f"total_inactive_file {50 * MiB}\n"),
    })


def test_v2_takes_the_tightest_limit_over_the_ancestors_and_its_headroom(
        tmp_path: Path) -> None:
    # The service's own memory.max is "max": its slice's 2 GiB binds it, and what is left
    # is the slice's, whose 1.5 GiB include its other services: 2 GiB - (1.5 GiB - 256 MiB).
    assert cgroup_memory(v2_nested(tmp_path)) == CgroupMemory(
        limit=2 * GiB, available=2 * GiB - (3 * GiB // 2 - 256 * MiB))


def test_v2_a_child_limit_tighter_than_its_parents_binds(tmp_path: Path) -> None:
    root = v2_nested(tmp_path)
    service = root / "sys/fs/cgroup/system.slice/wasinn.service"
    (service / "memory.max").write_text(f"{512 * MiB}\n")
    assert cgroup_memory(root) == CgroupMemory(limit=512 * MiB,
                                               available=512 * MiB - 90 * MiB)


@pytest.mark.parametrize("mountinfo", [V2_MOUNT + "\n", None],
                         ids=["mounted", "no-mountinfo"])
def test_v2_inside_a_container_namespace_reads_the_mount_as_its_cgroup(
        tmp_path: Path, mountinfo: str | None) -> None:
    # "0::/" is the namespace's root, the container's own cgroup, mounted at
    # /sys/fs/cgroup; without mountinfo that is where it is assumed to be.
    assert cgroup_memory(v2_container(tmp_path, mountinfo)) == CgroupMemory(
        limit=GiB, available=GiB - 200 * MiB)


def test_v1_reads_the_memory_hierarchy_and_its_unlimited_value(tmp_path: Path) -> None:
    root = v1_docker(tmp_path)
    assert cgroup_memory(root) == CgroupMemory(limit=512 * MiB,
                                               available=512 * MiB - 150 * MiB)
    (root / "sys/fs/cgroup/memory/memory.limit_in_bytes").write_text(V1_UNLIMITED + "\n")
    assert cgroup_memory(root) is None


@pytest.mark.parametrize("own", [f"{512 * MiB}", V1_UNLIMITED], ids=["limited", "unlimited"])
def test_v1_takes_the_kernels_limit_over_ancestors_outside_the_mount(tmp_path: Path,
                                                                     own: str) -> None:
    # The container's parent (not mounted here) is limited to 256 MiB.
    root = v1_docker(tmp_path, f"{256 * MiB}")
    (root / "sys/fs/cgroup/memory/memory.limit_in_bytes").write_text(own)
    assert cgroup_memory(root) == CgroupMemory(limit=256 * MiB,
                                               available=256 * MiB - 150 * MiB)


def test_v1_walks_up_a_whole_hierarchy_to_a_limited_parent(tmp_path: Path) -> None:
    # This machine's layout: the whole hierarchy mounted, the limit on a parent.
    parent = "sys/fs/cgroup/memory/process_api"
    root = fake_tree(tmp_path, "4:memory:/process_api/8637\n0::/\n", v1_mount("/") + "\n", {
        "sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED,
        f"{parent}/memory.limit_in_bytes": f"{GiB}",
        f"{parent}/memory.usage_in_bytes": f"{400 * MiB}",
        f"{parent}/memory.stat": f"total_inactive_file {100 * MiB}\n",
        f"{parent}/8637/memory.limit_in_bytes": V1_UNLIMITED,
        f"{parent}/8637/memory.usage_in_bytes": f"{8 * MiB}",
    })
    assert cgroup_memory(root) == CgroupMemory(limit=GiB, available=GiB - 300 * MiB)


def test_a_space_in_the_mount_point_is_unescaped(tmp_path: Path) -> None:
    root = fake_tree(tmp_path, "0::/\n", V2_MOUNT.replace("/sys/fs/cgroup", r"/cg\040roup"),
                     {"cg roup/memory.max": f"{GiB}", "cg roup/memory.current": "0"})
    assert cgroup_memory(root) == CgroupMemory(limit=GiB, available=GiB)


def test_usage_over_the_limit_leaves_nothing_and_no_usage_leaves_it_unknown(
        tmp_path: Path) -> None:
    root = v2_container(tmp_path)
    (root / "sys/fs/cgroup/memory.current").write_text(f"{3 * GiB}")
    assert cgroup_memory(root) == CgroupMemory(limit=GiB, available=0)
    (root / "sys/fs/cgroup/memory.current").unlink()
    assert cgroup_memory(root) == CgroupMemory(limit=GiB, available=None)


@pytest.mark.parametrize(("cgroup", "mountinfo", "files"), [
    (None, None, {}),  # no /proc at all (not Linux)
    ("0::/\n", V2_MOUNT, {}),  # the real root: no memory.max
    ("0::/\n", V2_MOUNT, {"sys/fs/cgroup/memory.max": "max\n"}),
    ("0::/user.slice\n", None, {"sys/fs/cgroup/user.slice/memory.max": "1024"}),  # no v2 mark
    ("4:memory:/\n", "", {"sys/fs/cgroup/memory/memory.limit_in_bytes": "1024"}),  # unmounted
    ("4:memory:/elsewhere\n", v1_mount("/docker/abc"),  # beside the part mounted
     {"sys/fs/cgroup/memory/memory.limit_in_bytes": "1024"}),
    ("0::/../../outside\n", V2_MOUNT, {"sys/fs/cgroup/memory.max": "1024"}),
    ("0::/\n", V2_MOUNT.replace(" / /sys", " /.. /sys"),  # mounted from outside the namespace
     {"sys/fs/cgroup/memory.max": "1024"}),
    ("0::/\n", V2_MOUNT.replace(" / /sys", " /child /sys"),  # a cgroup below this one
     {"sys/fs/cgroup/memory.max": "1024"}),
], ids=["no-proc", "v2-root", "v2-max", "unmarked", "v1-unmounted", "v1-beside", "outside",
        "mounted-from-outside", "mounted-below"])
def test_no_cgroup_or_no_limit_reads_as_none(tmp_path: Path, cgroup: str | None,
                                            mountinfo: str | None,
                                            files: dict[str, str]) -> None:
    assert cgroup_memory(fake_tree(tmp_path, cgroup, mountinfo, files)) is None


@pytest.mark.parametrize("limit", [
    "", "lots", "-5", "1.5e9", "1_000", "0x400", "٣", "9" * 21, b"\xff\xfe", "1024 2048",
], ids=repr)
def test_a_garbage_limit_is_no_limit(tmp_path: Path, limit: str | bytes) -> None:
    root = v2_container(tmp_path)
    path = root / "sys/fs/cgroup/memory.max"
    path.write_bytes(limit if isinstance(limit, bytes) else limit.encode())
    assert cgroup_memory(root) is None


@pytest.mark.parametrize("garbage", [
    {"proc/self/cgroup": "garbage\n::\n0:/nocolon\n\x00\n"},
    {"proc/self/cgroup": b"\xff0::/\n"},
    {"proc/self/mountinfo": "garbage\n1 2 - cgroup2\n - - -\n"},
    {"sys/fs/cgroup/memory.current": "many"},
    {"sys/fs/cgroup/memory.stat": b"\xffinactive_file 1\n"},
    {"sys/fs/cgroup/memory.stat": "inactive_file\ninactive_file lots\n\n  \n"},
], ids=["cgroup-lines", "cgroup-bytes", "mountinfo-lines", "current", "stat-bytes", "stat"])
def test_garbage_around_a_limit_reads_as_what_can_be_read(
        tmp_path: Path, garbage: dict[str, str | bytes]) -> None:
    root = v2_container(tmp_path)
    for path, text in garbage.items():
        (root / path).write_bytes(text if isinstance(text, bytes) else text.encode())
    reading = cgroup_memory(root)
    if "proc/self/cgroup" in garbage:
        assert reading is None  # no cgroup named
    elif "proc/self/mountinfo" in garbage:
        assert reading is None  # no cgroup2 mount listed
    elif "sys/fs/cgroup/memory.current" in garbage:
        assert reading == CgroupMemory(limit=GiB, available=None)
    else:  # no inactive file cache reckoned: the whole usage counts
        assert reading == CgroupMemory(limit=GiB, available=GiB - 300 * MiB)


def test_a_directory_where_a_file_should_be_reads_as_nothing(tmp_path: Path) -> None:
    root = v2_container(tmp_path)
    (root / "sys/fs/cgroup/memory.max").unlink()
    (root / "sys/fs/cgroup/memory.max").mkdir()
    assert cgroup_memory(root) is None


def machine_reads(monkeypatch: pytest.MonkeyPatch, *, total: int, available: int) -> None:
    """Make psutil read the machine's memory as ``total`` bytes, ``available`` of them
    available now."""
    reading = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory",
                        lambda: reading._replace(total=total, available=available))


def in_cgroup(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """Make every read of this process's cgroup read the tree at ``root``."""
    read = cgroup_memory
    monkeypatch.setattr(_cgroup, "cgroup_memory", lambda _root=None: read(root))


def test_the_memory_available_is_the_cgroups_where_lower(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # 64 GiB machine, 10 GiB free, in a container limited to 1 GiB holding 300 MiB.
    machine_reads(monkeypatch, total=64 * GiB, available=10 * GiB)
    root = v2_container(tmp_path)
    assert available_memory(root) == GiB - 200 * MiB
    assert total_memory(root) == GiB
    machine_reads(monkeypatch, total=64 * GiB, available=100 * MiB)  # the machine is short
    assert available_memory(root) == 100 * MiB
    assert total_memory(root) == GiB
    machine_reads(monkeypatch, total=512 * MiB, available=100 * MiB)  # a small machine
    assert total_memory(root) == 512 * MiB


def test_the_memory_is_the_machines_where_the_cgroup_is_unlimited(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    machine_reads(monkeypatch, total=64 * GiB, available=10 * GiB)
    for root in (v2_nested(tmp_path / "v2"), v1_docker(tmp_path / "v1")):
        limit = root / ("sys/fs/cgroup/system.slice/memory.max" if root.name == "v2"
                        else "sys/fs/cgroup/memory/memory.limit_in_bytes")
        limit.write_text("max\n" if root.name == "v2" else V1_UNLIMITED)
        assert available_memory(root) == 10 * GiB
        assert total_memory(root) == 64 * GiB
    assert available_memory(tmp_path / "nothing") == 10 * GiB
    assert total_memory(tmp_path / "nothing") == 64 * GiB


def test_the_memory_available_is_at_most_the_limit_where_the_cgroups_usage_is_unknown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the machine's 10 GiB, over the cgroup's 1 GiB limit.
    machine_reads(monkeypatch, total=64 * GiB, available=10 * GiB)
    root = v2_container(tmp_path)
    (root / "sys/fs/cgroup/memory.current").unlink()
    assert available_memory(root) == GiB
    assert total_memory(root) == GiB  # the limit is still known
    machine_reads(monkeypatch, total=64 * GiB, available=100 * MiB)
    assert available_memory(root) == 100 * MiB


def test_a_limited_cgroup_of_unknown_usage_caps_a_looser_parents_headroom(
        tmp_path: Path) -> None:
    # Before: limit 1 GiB, available 9 GiB (the 10 GiB parent's headroom).
    root = fake_tree(tmp_path, "0::/slice/leaf\n", V2_MOUNT + "\n", {
        "sys/fs/cgroup/cgroup.controllers": "memory\n",
        "sys/fs/cgroup/slice/memory.max": f"{10 * GiB}\n",
        "sys/fs/cgroup/slice/memory.current": f"{GiB}\n",
        "sys/fs/cgroup/slice/leaf/memory.max": f"{GiB}\n",
    })
    assert cgroup_memory(root) == CgroupMemory(limit=GiB, available=GiB)


def test_a_sandboxed_graphs_default_bound_is_half_the_cgroups_limit_where_lower(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    machine_reads(monkeypatch, total=64 * GiB, available=10 * GiB)
    in_cgroup(monkeypatch, v1_docker(tmp_path / "limited"))
    assert default_max_bytes() == 256 * MiB
    in_cgroup(monkeypatch, tmp_path / "nothing")
    assert default_max_bytes() == 32 * GiB


def test_the_hosts_default_bound_on_sandbox_processes_counts_the_cgroups_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One process per 256 MiB of half the memory (at most PROCESSES_PER_CPU a CPU, at
    # least LEAST_DEFAULT): 8 under a 4 GiB limit, up to 128 on the 64 GiB machine.
    cpus = len(os.sched_getaffinity(0))

    def expected(memory: int) -> int:
        return max(LEAST_DEFAULT, min(PROCESSES_PER_CPU * cpus, memory // 2 // MEMORY_PER_PROCESS))

    machine_reads(monkeypatch, total=64 * GiB, available=10 * GiB)
    root = v2_container(tmp_path)
    (root / "sys/fs/cgroup/memory.max").write_text(f"{4 * GiB}")
    in_cgroup(monkeypatch, root)
    assert default_max_processes() == expected(4 * GiB) == min(8, PROCESSES_PER_CPU * cpus)
    in_cgroup(monkeypatch, tmp_path / "nothing")
    assert default_max_processes() == expected(64 * GiB)


def test_zero_inputs_over_the_cgroups_memory_are_refused_though_the_machine_has_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 1 GiB of zeros on a machine with 10 GiB free, in a container with 824 MiB left:
    # the check that refuses it before it is allocated (warm-ups, wasinn infer --zeros).
    machine_reads(monkeypatch, total=64 * GiB, available=10 * GiB)
    in_cgroup(monkeypatch, v2_container(tmp_path))
    spec = [TensorSpec("x", TensorType.U8, (None,))]
    with pytest.raises(TooLargeError, match=(
            r"^input 'x': a zero-filled u8 value of shape \[1073741824\] takes "
            r"1,073,741,824 bytes, which cannot be allocated here \(864,026,624 bytes of "
            r"memory are available now\): expected a smaller shape$")):
        zero_inputs(spec, {"x": (GiB,)})


def test_the_real_cgroup_reads_without_failing() -> None:
    reading = cgroup_memory()
    assert reading is None or (reading.limit > 0 and (
        reading.available is None or 0 <= reading.available <= reading.limit))
    machine = psutil.virtual_memory()
    assert 0 < total_memory() <= machine.total
    assert 0 <= available_memory() <= machine.total
