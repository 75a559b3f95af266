"""The platform decisions of tplab.platforms, for every platform, on any machine."""

from __future__ import annotations

import sys

from tplab import platforms
from tplab.platforms import Platform


def test_system_names():
    assert platforms.system_name("darwin") == "macos"
    assert platforms.system_name("win32") == "windows"
    assert platforms.system_name("cygwin") == "windows"
    assert platforms.system_name("linux") == "linux"


def test_fork_server_only_on_linux():
    assert platforms.default_fork(Platform(system="linux")) is True
    # forking after torch is imported crashes on macOS (objc_initializeAfterForkError)
    assert platforms.default_fork(Platform(system="macos", loopback="lo0")) is False
    assert platforms.default_fork(Platform(system="windows")) is False


def test_rendezvous_on_loopback_everywhere():
    for system, lo in (("linux", "lo"), ("macos", "lo0"), ("windows", None)):
        p = Platform(system=system, loopback=lo)
        assert platforms.rendezvous_host(p) == "127.0.0.1"
        env = platforms.rank_env(p)
        assert env.get("GLOO_SOCKET_IFNAME") == lo
    assert platforms.rank_env(Platform(system="macos", loopback="lo0")) == {
        "GLOO_SOCKET_IFNAME": "lo0"}


def test_windows_has_no_libuv():
    p = Platform(system="windows", loopback="Loopback Pseudo-Interface 1")
    assert platforms.rank_env(p)["USE_LIBUV"] == "0"
    assert platforms.store_options(p) == {"use_libuv": False}
    assert platforms.store_options(Platform(system="linux")) == {}
    assert "USE_LIBUV" not in platforms.rank_env(Platform(system="linux"))


def test_engines_use_the_kernels_python():
    assert platforms.engine_python(Platform(jupyterhub=True)) == sys.executable
    assert platforms.engine_python(Platform(executable="/opt/hub/bin/python")) == \
        "/opt/hub/bin/python"


def test_colab_gets_world_size_2_and_keeps_torch():
    colab = Platform(colab=True, cpus=2, gpus=1)
    assert platforms.suggested_world_size(colab) == 2
    assert platforms.suggested_world_size(Platform(cpus=8)) == 4
    note = next(n for n in platforms.notes(colab) if n.name == "Colab")
    assert "world_size=2" in note.text and "torch" in note.text and not note.problem


def test_small_shm_is_a_problem_only_for_nccl():
    small = Platform(container=True, shm_bytes=64 * platforms.MiB, gpus=2)
    shm = next(n for n in platforms.notes(small) if n.name == "shared memory")
    assert shm.problem and "64 MiB" in shm.text and "--shm-size" in shm.fix
    cpu = Platform(container=True, shm_bytes=64 * platforms.MiB, gpus=0)
    shm = next(n for n in platforms.notes(cpu) if n.name == "shared memory")
    assert not shm.problem
    big = Platform(shm_bytes=8 * 2**30, gpus=2)
    assert not [n for n in platforms.notes(big) if n.name == "shared memory"]


def test_no_loopback_is_a_problem():
    notes = platforms.notes(Platform(loopback=None))
    assert any(n.problem and "127.0.0.1" in n.text for n in notes)


def test_each_platform_names_itself():
    names = {n.name for n in platforms.notes(Platform(system="macos", loopback="lo0"))}
    assert names == {"macOS"}
    names = {n.name for n in platforms.notes(Platform(system="windows"))}
    assert names == {"Windows"}
    hub = platforms.notes(Platform(jupyterhub=True, executable="/hub/python"))
    assert [n.text for n in hub if n.name == "JupyterHub"] == [
        "engines run the kernel's own Python (/hub/python)"]


def test_detect_this_machine():
    p = platforms.detect()
    assert p.system == platforms.system_name()
    assert p.cpus >= 1 and p.executable == sys.executable
