"""StepThreadShare: the step thread's torch threads while a grammar compiles (issue 25).

The oracle is torch itself: ``torch.get_num_threads()`` on the thread that steps. The
end-to-end effect (streams' gaps while a 20,000-choice grammar compiles beside them) is
measured in tests/server/test_grammar_compile.py.
"""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.structured_output.backend import compile_threads
from kvpilot.engine.structured_output.cpu_share import StepThreadShare


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 4, 16])
def test_cpu_steps_leave_the_compile_its_threads_and_take_them_back(torch_threads, threads):
    share = StepThreadShare(torch.device("cpu"), threads=threads)
    torch.set_num_threads(threads)
    share.update(False)
    assert torch.get_num_threads() == threads
    share.update(True)
    assert torch.get_num_threads() == max(1, threads - compile_threads()) == share.current
    share.update(True)                 # steady while the compile runs
    assert torch.get_num_threads() == share.current
    share.update(False)
    assert torch.get_num_threads() == threads == share.current


def test_the_base_count_is_the_step_threads_own_setting(torch_threads):
    torch.set_num_threads(3)
    share = StepThreadShare(torch.device("cpu"))
    share.update(True)
    assert torch.get_num_threads() == max(1, 3 - compile_threads())
    share.update(False)
    assert torch.get_num_threads() == 3


def test_other_devices_keep_their_threads(torch_threads):
    share = StepThreadShare(torch.device("meta"), threads=8)
    torch.set_num_threads(2)
    share.update(True)
    assert torch.get_num_threads() == 2
