"""What a CPU decode step streams lives in transparent huge pages (``engine/model/huge_pages.py``).

The oracle is the Linux kernel's own accounting: ``AnonHugePages`` of the mapping that
holds a tensor, in ``/proc/self/smaps``. Outputs must not change: a model's outputs after
its parameters moved equal those before, bit for bit.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpilot.engine.model import huge_pages
from kvpilot.engine.model.huge_pages import HUGE_PAGE_BYTES

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The bracketed mode ("always", "madvise", "never"), or None without THP."""
    if not THP_MODE.exists():
        return None
    text = THP_MODE.read_text()
    return text[text.index("[") + 1:text.index("]")]


needs_thp = pytest.mark.skipif(_thp_mode() in (None, "never"), reason="no transparent huge pages here")


def _huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of this process's mapping that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_thp
def test_a_large_tensor_is_backed_by_huge_pages():
    t = huge_pages.zeros((3 << 20,), torch.float32)   # 12 MiB: six huge pages
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0 and t.shape == (3 << 20,) and t.dtype == torch.float32
    assert torch.count_nonzero(t) == 0
    assert _huge_kib(t.data_ptr()) >= 8 << 10, "fewer than 4 of its 6 huge pages"
    if _thp_mode() == "madvise":   # the control: without the advice, 4 KiB pages
        assert _huge_kib_of_a_plain_tensor_in_a_fresh_process() == 0


def _huge_kib_of_a_plain_tensor_in_a_fresh_process() -> int:
    """The control runs where nothing else has run: in a long test process, malloc may serve
    a plain tensor from memory that other code advised (CI on a7b5e74 saw 32 MiB of huge
    pages under a plain ``torch.zeros`` when ``empty`` still took its memory from malloc)."""
    code = inspect.getsource(_huge_kib) + (
        "import torch\n"
        "plain = torch.zeros(3 << 20, dtype=torch.float32)\n"
        "print(_huge_kib(plain.data_ptr()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_small_tensors_are_ordinary_ones():
    t = huge_pages.empty((3, 5), torch.bfloat16)
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert huge_pages.zeros((7,), torch.int32).tolist() == [0] * 7


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16384, 64)            # 4 MiB
        self.norm = torch.nn.LayerNorm(64)
        self.head = torch.nn.Linear(64, 16384, bias=True)
        self.head.weight = self.embed.weight                  # tied, as small LMs do
        self.first_bias = torch.nn.Parameter(self.head.bias.data[:8])   # shares head.bias's storage

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)))


def test_gathered_parameters_keep_values_ties_and_outputs():
    torch.manual_seed(0)
    model = _Tied().eval()
    ids = torch.randint(0, 16384, (5,))
    before = model(ids).detach().clone()
    shared = (model.head.bias.data_ptr(), model.first_bias.data_ptr())
    moved = huge_pages.gather_parameters(model)

    assert torch.equal(model(ids), before)
    assert model.head.weight is model.embed.weight
    gathered = [model.embed.weight, model.norm.weight, model.norm.bias]
    assert moved >= sum(p.numel() * p.element_size() for p in gathered)
    assert len({p.untyped_storage().data_ptr() for p in gathered}) == 1   # one buffer
    # parameters that share storage with another stay where they were, still shared
    assert (model.head.bias.data_ptr(), model.first_bias.data_ptr()) == shared


@needs_thp
def test_the_engine_holds_its_weights_and_kv_cache_in_huge_pages():
    from kvpilot.engine import LLM, SamplingParams
    from kvpilot.engine.model.builtin_model import packaged_smollm2

    llm = LLM(str(packaged_smollm2()), max_model_len=512, max_num_seqs=2, kv_cache_memory_bytes=64 << 20)
    runner = llm.llm_engine.runner
    kv = runner.kv_caches if isinstance(runner.kv_caches, torch.Tensor) else runner.kv_caches[0]
    assert _huge_kib(kv.data_ptr()) > 0
    layer = runner.model.layers[0]
    assert _huge_kib(layer.mlp.gate_up_proj.weight.data_ptr()) > 0   # 1.1 MB: huge only gathered
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=4))
    assert "Paris" in out[0].outputs[0].text
