"""The CUDA handlers declare themselves command-buffer compatible: XLA may record them into a CUDA graph and
replay it. A jitted forward+backward (deterministic, so results are bitwise reproducible) runs in a fresh
process with XLA's command buffers enabled for custom calls and in one without; the results must be bitwise
equal, and XLA's own output must show the jaxflash custom calls inside a command buffer. XLA reads its flags
once per process, hence the subprocesses.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from jaxflash import _ffi

pytestmark = pytest.mark.gpu

COMMAND_BUFFER_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"

SCRIPT = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
import jaxflash

out_file, hlo_file = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(0)
q, do = (jnp.asarray(rng.standard_normal((2, 300, 4, 128)), jnp.bfloat16) for _ in range(2))
k, v = (jnp.asarray(rng.standard_normal((2, 257, 2, 128)), jnp.bfloat16) for _ in range(2))

@jax.jit
def step(q, k, v, do):
    o, vjp = jax.vjp(lambda q, k, v: jaxflash.attention(q, k, v, causal=True, deterministic=True,
                                                        backend="cuda"), q, k, v)
    return (o, *vjp(do))

compiled = step.lower(q, k, v, do).compile()
with open(hlo_file, "w") as f:
    f.write(compiled.as_text())
runs = [step(q, k, v, do) for _ in range(3)]  # the first call may run eagerly to warm up; later ones replay
np.savez(out_file, **{f"r{i}_{j}": np.asarray(x).view(np.uint16) for i, r in enumerate(runs) for j, x in enumerate(r)})
"""


@pytest.fixture(autouse=True)
def _need_cuda_module():
    if not _ffi.cuda_built():
        pytest.skip("jaxflash was built without its CUDA module")


def _run(tmp_path: pathlib.Path, name: str, xla_flags: str):
    out, hlo, dump = tmp_path / f"{name}.npz", tmp_path / f"{name}.hlo", tmp_path / f"{name}_dump"
    env = dict(os.environ, XLA_FLAGS=f"{xla_flags} --xla_dump_to={dump}".strip(), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out), str(hlo)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name} run failed:\n{proc.stdout}\n{proc.stderr}"
    return dict(np.load(out)), hlo.read_text(), dump


def _command_buffer_text(hlo: str, dump: pathlib.Path) -> str:
    """XLA's record of what it put into command buffers: the `command_buffer` computations of the optimized
    HLO, or, where XLA forms command buffers from its thunk sequence instead, the dumped thunk sequences."""
    blocks = [b for b in hlo.split("\n\n") if "command_buffer" in b.split("\n", 1)[0]]
    for path in sorted(dump.glob("*thunk*")):
        blocks.append(path.read_text(errors="replace"))
    return "\n\n".join(blocks)


def test_custom_calls_run_in_command_buffer_bitwise(tmp_path):
    plain, _, _ = _run(tmp_path, "plain", "--xla_gpu_enable_command_buffer=")
    graph, hlo, dump = _run(tmp_path, "graph", COMMAND_BUFFER_FLAGS)
    for key in plain:
        assert key in graph
        np.testing.assert_array_equal(graph[key], plain[key], err_msg=key)
    recorded = _command_buffer_text(hlo, dump)
    files = sorted(p.name for p in dump.iterdir()) if dump.exists() else []
    for target in ("jaxflash_fwd", "jaxflash_bwd"):
        assert target in recorded, (f"{target} is not inside a command buffer; command-buffer text:\n"
                                    f"{recorded[:4000]}\ndump files: {files[:60]}")
