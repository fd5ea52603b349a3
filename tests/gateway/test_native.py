"""Process settings of the engine's native side: freed arrays stay with the process."""

import subprocess
import sys

import pytest

# A step's arrays, as a model call makes them: a dozen of 4 MiB alive together, then all freed; ten
# steps after a first one. The page faults they cost.
FAULTS = """
import resource, sys
import numpy as np
from gateway.engine.native import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
def step():
    arrays = [np.ones(1 << 20, dtype=np.float32) for _ in range(12)]
    del arrays
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True).stdout
    kept, faults = out.split()
    return kept, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_arrays_made_and_freed_in_turn_reuse_their_memory_instead_of_faulting_in_new_pages():
    kept, faulted = _faults("keep")
    default, fresh = _faults("default")
    assert kept == "True" and default == "None"
    assert fresh >= 10 * 12 * 1024 // 4  # by default the freed arrays go back to the kernel: new pages each step
    assert faulted < fresh / 20, (faulted, fresh)
