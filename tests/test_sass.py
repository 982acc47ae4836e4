"""The sm90 kernels of the built CUDA module are made of the Hopper instructions they are designed around.

No GPU needed: `cuobjdump --dump-sass` (the nvidia-cuda-cuobjdump and -nvdisasm wheels of the test extras) reads
the module's sm_90a code. Built for plain sm_90, the same source compiles but every wgmma becomes a trap and the
register hand-over disappears; without the extended-shape define a 128x80 tile silently becomes 16-wide MMAs.
Each sm90 forward kernel must hold warpgroup MMAs with both operands in shared memory (Q·Kᵀ) and with P from
registers (P·V), TMA loads, the register reallocation of the producer and the consumers, and no trap.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

from jaxflash import _ffi


def _tool(name):
    found = shutil.which(name)
    if found:
        return found
    for prefix in sys.path:  # the pip wheels put the binary under nvidia/cu*/bin
        hits = sorted(glob.glob(os.path.join(prefix, "nvidia", "cu*", "bin", name)))
        if hits:
            return hits[-1]
    return None


def _sass_by_function(module_path):
    cuobjdump = _tool("cuobjdump")
    nvdisasm = _tool("nvdisasm")
    if cuobjdump is None or nvdisasm is None:
        pytest.fail("cuobjdump and nvdisasm are needed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, "
                    "part of jaxflash[test] on Linux x86-64)")
    env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", ""))
    out = subprocess.run([cuobjdump, "--dump-sass", "-arch", "sm_90a", module_path], env=env, check=True,
                         capture_output=True, text=True).stdout
    functions = {}
    for chunk in out.split("Function : ")[1:]:
        name, _, body = chunk.partition("\n")
        functions[name.strip()] = body
    return functions


def test_sm90_forward_kernels_use_wgmma_tma_and_setmaxnreg():
    if not _ffi.cuda_built():
        pytest.skip("jaxflash was built without its CUDA module")
    configs = [(t, d) for f, p, t, d in _ffi.cuda_configs() if f == "sm90" and p == "fwd"]
    if not configs:
        pytest.skip("the CUDA module was built without sm_90a (no sm90 configuration)")
    from jaxflash import _jaxflash_cuda

    functions = _sass_by_function(_jaxflash_cuda.__file__)
    kernels = {n: b for n, b in functions.items() if n.startswith("_ZN8jaxflash4sm9016flash_fwd_kernel")}
    # Three variants per configuration (plain; segment ids and softcap; those and dropout), and the same three
    # with the last round's tiles split between all SMs at head dims 128 and up (cuda/sm90/schedule.h).
    assert len(kernels) == 3 * len(configs) + 3 * sum(d >= 128 for _, d in configs), sorted(kernels)
    for name, body in kernels.items():
        # fp32 accumulation; the SASS names bf16 inputs (".BF16") and leaves fp16, the default, unnamed.
        assert re.search(r"HGMMA\.64x\d+x16\.F32(\.BF16)? R\d+, gdesc\[", body), f"{name}: no Q·Kᵀ wgmma (SS)"
        assert re.search(r"HGMMA\.64x\d+x16\.F32(\.BF16)? R\d+, R\d+, gdesc\[", body), \
            f"{name}: no P·V wgmma with P from registers (RS)"
        assert "HGMMA.64x16x16" not in body, f"{name}: 16-wide wgmma (extended shapes not enabled?)"
        assert "UTMALDG" in body, f"{name}: no TMA load"
        assert "USETMAXREG.DEALLOC" in body and "USETMAXREG.TRY_ALLOC" in body, f"{name}: no setmaxnreg"
        assert "BPT.TRAP" not in body, f"{name}: a trap (built for sm_90 instead of sm_90a?)"


def test_sm90_backward_kernels_use_wgmma_tma_and_setmaxnreg():
    if not _ffi.cuda_built():
        pytest.skip("jaxflash was built without its CUDA module")
    configs = [(t, d) for f, p, t, d in _ffi.cuda_configs() if f == "sm90" and p == "bwd"]
    if not configs:
        pytest.skip("the CUDA module was built without sm_90a (no sm90 backward configuration)")
    from jaxflash import _jaxflash_cuda

    functions = _sass_by_function(_jaxflash_cuda.__file__)
    kernels = {n: b for n, b in functions.items() if n.startswith("_ZN8jaxflash4sm9016flash_bwd_kernel")}
    split_d = {n: b for n, b in functions.items() if n.startswith("_ZN8jaxflash4sm9024flash_bwd_split_d_kernel")}
    n_split = sum(d > 128 for _, d in configs)
    # Up to d = 128, six variants per configuration: no extras and all of them, each also for
    # deterministic=True, and softcap alone and dropout alone (the template's arguments: the Extras kind
    # kNone, kSoftcap, kDropout, kAll as 0-3, then deterministic; e.g. ...ExtrasE0ELb1EEEv for the
    # deterministic plain kernel). Past 128, the split-d kernel: with and without the extras (its deterministic
    # calls run the sm80 backward).
    flags = {n: re.search(r"ExtrasE([0-3])ELb([01])EEEv", n).groups() for n in kernels}
    ordered = [n for n, f in flags.items() if f[1] == "1"]
    n_small = len(configs) - n_split
    assert len(kernels) == 6 * n_small, sorted(kernels)
    want = ([(x, "0") for x in "0123"] + [("0", "1"), ("3", "1")]) * n_small
    assert sorted(flags.values()) == sorted(want), sorted(kernels)
    assert len(split_d) == 2 * n_split, sorted(split_d)
    for name, body in split_d.items():
        # Every GEMM with both operands in shared memory; dQ added by bulk reduce-adds of a register-order tile.
        assert re.search(r"HGMMA\.64x\d+x16\.F32(\.BF16)? R\d+, gdesc\[", body), f"{name}: no SS wgmma"
        assert "UBLKRED.G.S.ADD.F32" in body, f"{name}: no bulk reduce-add of dQ"
        assert "UTMALDG" in body and "UTMASTG" in body, f"{name}: no TMA load or store"
        assert "USETMAXREG.DEALLOC" in body and "USETMAXREG.TRY_ALLOC" in body, f"{name}: no setmaxnreg"
        assert "BPT.TRAP" not in body, f"{name}: a trap (built for sm_90 instead of sm_90a?)"
    for name, body in kernels.items():
        # dQ: one bulk reduce-add of a register-order tile at 64 and 80 query rows, a TMA reduce-add at 128.
        rows = int(re.search(r"ELi\d+ELi(\d+)EEELNS0_6Extras", name).group(1))
        if rows in (64, 80):
            assert "UBLKRED.G.S.ADD.F32" in body, f"{name}: no bulk reduce-add of dQ"
        else:
            assert "UTMAREDG" in body, f"{name}: no TMA reduce-add of dQ"
        if rows == 80:  # dS stored transposed by stmatrix, for dQᵀ = Kᵀ·dSᵀ
            assert "STSM.16.MT88" in body, f"{name}: no transposing stmatrix of dS"
        if name in ordered:  # the turn counters: an acquire load (the wait) and a release store (the pass)
            assert "LDG.E.STRONG.GPU" in body and "STG.E.STRONG.GPU" in body, f"{name}: no turn counters"
        # Sᵀ, dPᵀ and dQ with both operands in shared memory; dV and dK with Pᵀ, dSᵀ from registers.
        assert re.search(r"HGMMA\.64x\d+x16\.F32(\.BF16)? R\d+, gdesc\[", body), f"{name}: no SS wgmma"
        assert re.search(r"HGMMA\.64x\d+x16\.F32(\.BF16)? R\d+, R\d+, gdesc\[", body), \
            f"{name}: no dV/dK wgmma with its A operand from registers (RS)"
        assert "UTMALDG" in body, f"{name}: no TMA load"
        assert "USETMAXREG.DEALLOC" in body and "USETMAXREG.TRY_ALLOC" in body, f"{name}: no setmaxnreg"
        assert "BPT.TRAP" not in body, f"{name}: a trap (built for sm_90 instead of sm_90a?)"
