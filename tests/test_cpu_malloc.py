"""glibc's malloc keeps a step's freed buffers once an engine is built on the CPU (minivllm.cpu_malloc, chapter 12),
never over the user's choice. Each case that allocates runs in a fresh interpreter: glibc's settings are the
process's, and this one's are set by the engines the other tests build."""

import os
import platform

import pytest

from minivllm.cpu_malloc import USER_VARIABLES, repeated_step_faults, users_choice

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")

def _faults_per_step(engine: bool, **env) -> tuple[float, str]:
    base = {k: v for k, v in os.environ.items() if k not in USER_VARIABLES}
    return repeated_step_faults(engine, {**base, **env})


def test_after_an_engine_on_the_cpu_a_repeated_steps_buffers_take_no_new_pages():
    plain, words = _faults_per_step(False)
    assert plain > 500, f"glibc's own settings hand the buffers back ({plain:.0f} faults a step): the case shows it"
    assert "no engine on the CPU" in words
    kept, words = _faults_per_step(True)
    assert kept < 50, f"{kept:.0f} page faults a step: the step's freed buffers went back to the kernel"
    assert "keeps freed memory" in words and "minivllm's default" in words


def test_the_users_allocator_settings_are_left_as_they_are():
    # a setting of the user's (glibc then also turns its dynamic thresholds off)
    faults, words = _faults_per_step(True, MALLOC_TOP_PAD_="131072")
    assert faults > 500, "minivllm changed the allocator the user had tuned"
    assert "MALLOC_TOP_PAD_ is set (the user's choice)" in words


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_ is set"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES sets glibc.malloc"),
    ({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"}, None),  # not the allocator
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"}, "LD_PRELOAD="),
    ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2:/opt/libgomp.so.1"}, "LD_PRELOAD="),
    ({"LD_PRELOAD": "/opt/torch/lib/libgomp.so.1"}, None),  # another library, not an allocator
])
def test_users_choice_names_what_the_user_set_for_the_allocator(env, expected):
    said = users_choice(env)
    assert said == expected if expected is None else said.startswith(expected)


@pytest.mark.skipif(users_choice() is not None, reason="this process's allocator is the user's")
def test_the_benchmark_says_what_its_engines_allocate_with(capsys):
    from minivllm.__main__ import main
    rc = main(["bench", "--workload", "offline", "--model", "tiny-random", "--num-requests", "2", "--output-len", "3",
               "3", "--compare", "none", "--no-roofline", "--quiet"])
    assert rc == 0
    assert "allocator: glibc malloc keeps freed memory (trim threshold 1024 MiB, mmap threshold 32 MiB" in \
        capsys.readouterr().out
