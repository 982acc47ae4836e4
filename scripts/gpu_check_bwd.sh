#!/usr/bin/env bash
# The one-command GPU check of the CUDA backward kernel (companion of gpu_check.sh, same conventions):
#   1. build and install jaxflash without build isolation, CUDA required;
#   2. pytest tests/test_gpu_backward.py (dq, dk, dv vs the float64 oracle, determinism, jit/vmap);
#   3. the fwd+bwd benchmark (benchmarks/bench_gpu_bwd.py; BENCH_ARGS passes options);
#   4. compute-sanitizer memcheck and racecheck on small backward cases (SKIP_SANITIZER=1 skips).
# Environment: JAXFLASH_CUDA_ARCHS, SKIP_BUILD=1, PYTEST_K (a pytest -k expression), BENCH_ARGS, SKIP_BENCH=1.
# Full logs go to $OUT (or a temporary folder); the last lines printed are the verdict table.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${OUT:-$(mktemp -d)}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
declare -a NAMES=() RESULTS=()
verdict() { NAMES+=("$1"); RESULTS+=("$2"); }

if ! "$PY" -c "import cutlass_library" 2>/dev/null && ls .whl/nvidia_cutlass-*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/nvidia_cutlass-*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null); $(nvcc --version | tail -1); \
jax $("$PY" -c 'import jax; print(jax.__version__)' 2>/dev/null); commit $(git rev-parse --short HEAD 2>/dev/null)"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  echo "== build ($(nproc) cores)"
  start=$(date +%s)
  if JAXFLASH_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$PY" -m pip install --no-build-isolation --no-deps -v . \
      >"$LOG/build.log" 2>&1; then
    verdict build "ok ($(( $(date +%s) - start )) s)"
  else
    grep -E "error" "$LOG/build.log" | head -20; tail -20 "$LOG/build.log"; verdict build "FAIL (see build.log)"
  fi
fi
cd /tmp  # import the installed package, not the source tree
REPO="$OLDPWD"

echo "== pytest test_gpu_backward.py"
if timeout "${PYTEST_TIMEOUT:-400}" "$PY" -m pytest -q --maxfail=5 -p no:cacheprovider -k "${PYTEST_K:-}" \
    "$REPO/tests/test_gpu_backward.py" >"$LOG/pytest_bwd.log" 2>&1; then
  verdict "pytest bwd" "ok: $(tail -1 "$LOG/pytest_bwd.log")"
else
  grep -E "^(FAILED|ERROR)|Error|assert" "$LOG/pytest_bwd.log" | head -30
  verdict "pytest bwd" "FAIL: $(tail -1 "$LOG/pytest_bwd.log")"
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo "== benchmark"
  if timeout "${BENCH_TIMEOUT:-400}" "$PY" "$REPO/benchmarks/bench_gpu_bwd.py" ${BENCH_ARGS:-} 2>&1 | tee "$LOG/bench_bwd.log"; then
    verdict benchmark "ok (bench_bwd.log)"
  else
    verdict benchmark "FAIL (bench_bwd.log)"
  fi
fi

if [ "${SKIP_SANITIZER:-0}" != 1 ]; then
  cat >/tmp/jaxflash_bwd_small.py <<'PYEOF'
import jax, jax.numpy as jnp, numpy as np, jaxflash
rng = np.random.default_rng(0)
for dtype, d, sq, sk, hq, hk, causal in [("bfloat16", 64, 113, 203, 4, 2, True), ("float16", 128, 239, 77, 2, 1, True),
                                         ("bfloat16", 256, 130, 70, 2, 2, False), ("bfloat16", 96, 65, 200, 3, 1, True)]:
    q, do = (jnp.asarray(rng.standard_normal((1, sq, hq, d)), dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((1, sk, hk, d)), dtype) for _ in range(2))
    for det in (False, True):
        _, vjp = jax.vjp(lambda q, k, v: jaxflash.attention(q, k, v, causal=causal, deterministic=det, backend="cuda"), q, k, v)
        assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in vjp(do))
print("small backward cases ran")
PYEOF
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool"
    if timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 9 --kernel-name kns=flash_bwd "$PY" \
        /tmp/jaxflash_bwd_small.py >"$LOG/sanitizer_bwd_$tool.log" 2>&1; then
      verdict "sanitizer $tool" "ok: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOG/sanitizer_bwd_$tool.log" | tail -1)"
    else
      tail -20 "$LOG/sanitizer_bwd_$tool.log"
      verdict "sanitizer $tool" "FAIL: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOG/sanitizer_bwd_$tool.log" | tail -1)"
    fi
  done
fi

echo
echo "== verdict (logs: $LOG)"
for i in "${!NAMES[@]}"; do printf '%-22s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"; done
