"""A kernel table given itself (exercise 18's extension point): ``EngineConfig(kernels=table)`` and
``load_model(kernels=table)`` run it, ``stats().kernels`` names it, two tables never share a model, and anything
else, a stub's table included, is refused with a ValueError naming ``kernels`` before anything is built."""

import shutil

import pytest
import torch

from minivllm import LLM, EngineConfig, SamplingParams
from minivllm.kernels import build, choose
from minivllm.kernels.cpu import CpuKernels
from minivllm.models import loader

from helpers import readers_loops

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler here: no table to build")

STUB = """#include "inner.h"
namespace minivllm {
inline void attend_tile(const AttentionTile& t) { MINIVLLM_NOT_WRITTEN(attend_tile); }
inline void q4_1_block_dot(const uint8_t* block, const float* x, int64_t x_stride, int rows, fvec* acc) {
  MINIVLLM_NOT_WRITTEN(q4_1_block_dot);
}
}  // namespace minivllm
"""


def table(tmp_path, text: str, name: str = "cpu (yours)") -> CpuKernels:
    """A table built from ``text`` as the inner loops (a copy of minivllm's, or a stub)."""
    path = tmp_path / f"inner_{abs(hash(text))}.cpp"
    path.write_text(text)
    return CpuKernels(build.load(build.build(path, quiet=True)), name)


def minivllms_loops(edit: str = "") -> str:
    return build.INNER.read_text() + edit


# Built once for the module (each distinct text is a compile of the C++ ops, seconds from an empty cache):
# a reader's table with minivllm's loops as exercise 18 builds them (tests/test_split_kv.py builds the same text: one
# compile), and a stub's.
@pytest.fixture(scope="module")
def yours(tmp_path_factory):
    return table(tmp_path_factory.mktemp("yours"), readers_loops())


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    return table(tmp_path_factory.mktemp("stub"), STUB)


def test_the_engine_runs_a_table_it_is_given_and_names_it(yours):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM("tiny-random", num_blocks=16, kernels=yours)
    assert llm.engine.stats().kernels == "cpu (yours)" and llm.engine.model.ops is yours
    assert llm.engine.runner.kv_cache.ops is yours  # the attention ops too, not only the model's
    got = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    want = LLM("tiny-random", num_blocks=16).generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want


def test_two_tables_never_share_a_model_and_only_the_latest_tables_are_kept(tmp_path, yours):
    first, second = yours, table(tmp_path, minivllms_loops("// two\n"))
    named = loader.load_model("tiny-random", "cpu", kernels="cpu")[0]
    a = loader.load_model("tiny-random", "cpu", kernels=first)[0]
    assert a.ops is first and loader.load_model("tiny-random", "cpu", kernels=first)[0] is a  # cached per table
    b = loader.load_model("tiny-random", "cpu", kernels=second)[0]
    assert b is not a and b.ops is second and a.ops is first  # its own model; the first table's is untouched
    assert all(k[4] is not first for k in loader._models)  # ... but no longer cached: one reader table's at a time
    assert loader.load_model("tiny-random", "cpu", kernels="cpu")[0] is named  # the named tables' models stay


def test_anything_else_is_refused_naming_kernels_before_a_model_is_built(monkeypatch, yours, stub):
    def refused(*args, **kwargs):
        raise AssertionError("a model was built for a refused kernels value")

    assert stub.not_written() == ["attend_tile", "q4_1_block_dot"]
    monkeypatch.setattr(loader, "_build", refused)
    for bad in (42, "fast", object(), torch.nn.Linear(2, 2)):
        with pytest.raises(ValueError, match=r"^kernels must be one of .* or a kernel table"):
            EngineConfig(model="tiny-random", kernels=bad)
    with pytest.raises(ValueError, match=r"^kernels must be a kernel table whose inner loops are written, got "
                                         r".*not written yet: attend_tile, q4_1_block_dot"):
        LLM("tiny-random", num_blocks=16, kernels=stub)
    with pytest.raises(ValueError, match=r"^kernels must be a table's name with tensor_parallel_size > 1"):
        EngineConfig(model="tiny-random", kernels=yours, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"^kernels must be a table's name .*disaggregated"):
        EngineConfig(model="tiny-random", kernels=yours, disaggregated=True)
    with pytest.raises(ValueError, match=r"cannot run here \(cpu, torch.bfloat16\)"):
        choose(yours, "cpu", torch.bfloat16)
    assert choose(yours, "cpu", torch.float32) == ("cpu (yours)", yours)


def test_a_stubs_op_raises_not_written_and_minivllms_own_build_has_none(stub):
    from minivllm.kernels import cpu_table

    mine = cpu_table()
    assert mine.not_written() == []
    q, cache = torch.randn(2, 3, 8), torch.randn(8, 1, 8)
    with pytest.raises(NotImplementedError, match="^not written yet: attend_tile$"):
        stub.paged_attention(q, cache, cache, torch.tensor([[0, 1]], dtype=torch.int32),
                             torch.tensor([5], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="block_table"):  # ops.cpp's checks still come first
        stub.paged_attention(q, cache, cache, torch.tensor([[0, 9]], dtype=torch.int32),
                             torch.tensor([5], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32), 4)
    assert shutil.which(build.compiler())
