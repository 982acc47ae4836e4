"""The CUDA handlers declare themselves command-buffer compatible: XLA may record them into a CUDA graph and
replay it. A jitted forward+backward (deterministic, so results are bitwise reproducible) and two decoding calls
(the split-KV decode kernel on a contiguous and on a paged cache) run in a fresh
process with XLA's command buffers enabled for custom calls and in one without; the results must be bitwise
equal, and XLA's own output must show the jaxflash custom calls inside a command buffer. XLA reads its flags
once per process, hence the subprocesses.
"""
from __future__ import annotations

import os
import pathlib
import re
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
# Decoding: one query row per head against a long cache (the decode kernel splits its keys), and the same
# cache in pages.
kl, vl = (jnp.asarray(rng.standard_normal((2, 8192, 2, 128)), jnp.bfloat16) for _ in range(2))
table = jnp.arange(2 * 512, dtype=jnp.int32).reshape(2, 512)[:, ::-1]
lengths = jnp.array([8192, 5000], jnp.int32)

@jax.jit
def step(q, k, v, do):
    o, vjp = jax.vjp(lambda q, k, v: jaxflash.attention(q, k, v, causal=True, deterministic=True,
                                                        backend="cuda"), q, k, v)
    decode = jaxflash.attention(q[:, :1], kl, vl, backend="cuda")
    paged = jaxflash.paged_attention(q[:, :1], kl.reshape(-1, 16, 2, 128), vl.reshape(-1, 16, 2, 128), table,
                                     lengths)
    return (o, *vjp(do), decode, paged)

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


def _targets_in_command_buffers(hlo: str, dump: pathlib.Path) -> set[str]:
    """The jaxflash custom-call targets that XLA put inside a command buffer. XLA records that either in the
    optimized HLO (computations named command_buffer*) or, in newer versions, in its dumped thunk sequence,
    where the thunks of a command buffer are listed indented under a kCommandBuffer thunk and the metadata
    names each thunk's HLO instruction."""
    found = set()
    for block in hlo.split("\n\n"):
        if "command_buffer" in block.split("\n", 1)[0]:
            found |= set(re.findall(r'custom_call_target="(jaxflash_\w+)"', block))
    target_of = dict(re.findall(r'%([\w.\-]+) = [^\n]*custom_call_target="(jaxflash_\w+)"', hlo))
    for seq in dump.glob("*jit_step*thunk_sequence_after_thunk_passes.txt"):
        meta = seq.with_name(seq.name.replace("thunk_sequence_after_thunk_passes", "thunk_metadata"))
        name_of = {int(i): name for name, i in
                   re.findall(r'profile_annotation: "([^"]+)"\s+thunk_id: (\d+)', meta.read_text())}
        buffer_indent = None  # indentation of the enclosing kCommandBuffer thunk, None outside one
        for line in seq.read_text().splitlines():
            m = re.match(r"(\s*)(\d+): (\w+)", line)
            if not m:
                continue
            indent, thunk_id, kind = len(m.group(1)), int(m.group(2)), m.group(3)
            if buffer_indent is not None and indent <= buffer_indent:
                buffer_indent = None
            if kind == "kCommandBuffer":
                buffer_indent = indent
            elif buffer_indent is not None and kind == "kCustomCall" and thunk_id in name_of:
                found.add(target_of.get(name_of[thunk_id]))
    return found - {None}


def test_custom_calls_run_in_command_buffer_bitwise(tmp_path):
    plain, _, _ = _run(tmp_path, "plain", "--xla_gpu_enable_command_buffer=")
    graph, hlo, dump = _run(tmp_path, "graph", COMMAND_BUFFER_FLAGS)
    for key in plain:
        assert key in graph
        np.testing.assert_array_equal(graph[key], plain[key], err_msg=key)
    files = sorted(p.name for p in dump.iterdir()) if dump.exists() else []
    assert _targets_in_command_buffers(hlo, dump) == {"jaxflash_fwd", "jaxflash_bwd", "jaxflash_paged_fwd"}, (
        f"the jaxflash custom calls are not all inside a command buffer; dump files: {files[:60]}")
