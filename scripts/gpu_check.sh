#!/usr/bin/env bash
# The one-command GPU check of the CUDA kernels, for a GPU machine without network access (jax with its
# CUDA plugin, nvcc, cmake, nanobind, scikit-build-core, pytest and nvidia-cutlass installed; a wheel of
# nvidia-cutlass in .whl/ is installed to /tmp/site when the package is missing).
#   1. build and install jaxflash without build isolation, CUDA required (JAXFLASH_CUDA=ON);
#   2. pytest -m gpu: forward and backward vs the float64 oracle (every dtype and head dim, odd lengths, GQA,
#      causal, every mask kind, softcap, dropout incl. CPU/CUDA mask equality, NaN padding, poisoned outputs,
#      determinism, jit/vmap/grad on the GPU), the decode kernel and paged_attention;
#   3. compute-sanitizer memcheck and racecheck on small forward and backward cases (masks, dropout and the
#      decode kernel too);
#   4. the benchmarks: `python -m jaxflash.bench --suite S` for each S in BENCH_SUITES (default "targets masks
#      dropout": the CUDA issues' target shapes, the mask speedups, the dropout cost; "sweep" is the full grid),
#      each with --out $LOG/bench_S (CSV, JSON, PNG); BENCH_ARGS passes further options to every suite.
# Full logs go to $OUT (or a temporary folder); the last lines printed are the verdict table, and the script
# exits 1 when any step failed (0 only when every step that ran passed).
# Steps 2 and 3 run once per kernel family of JAXFLASH_TEST_FAMILIES (default "auto sm80": on a Hopper GPU "auto"
# is the sm90 family where it has the configuration, "sm80" forces the mma.sync kernels).
# Environment: JAXFLASH_CUDA_ARCHS (default: CMake's 80-real;90a-real), WHEEL_DIR (build a wheel there and install
# it: one to carry to the next call), WHEEL (install that wheel, no build), SKIP_BUILD=1, SKIP_SANITIZER=1,
# RACECHECK_RUNS (default 3), SKIP_BENCH=1, BENCH_SUITES, BENCH_ARGS, PYTEST_PATHS (test files or folders relative
# to the repo, default "tests"), PYTEST_ARGS (default "-n 4" when pytest-xdist is installed: each worker's allocator
# keeps what it grew, and "-n 8" ran out of GPU memory on the forward file with both families; -n 4 took 147 s for
# the forward file with both families, -n 8 131 s; the bigmem tests run after them, alone). Timing on one
# H200 (16 cores): build 136-183 s for 90a-real; per family, forward + backward tests ~210 s and masks + command
# buffers ~200 s with -n 14; sanitizers ~30 s per family and run; the masks and dropout suites ~25 s with
# --impls jaxflash. On an H100 with -n 12: sm80 forward + backward 255 s, masks + command buffers over 300 s.
# Over the device tool's 10-minute call limit, so run it there in parts (WHEEL_DIR=$OUT/w in the first part, then
# carry that wheel and pass it as WHEEL): one family and one half of the tests per call, e.g.
# JAXFLASH_TEST_FAMILIES=auto with PYTEST_PATHS="tests/test_gpu_forward.py tests/test_gpu_backward.py", then with
# PYTEST_PATHS="tests/test_gpu_masks.py tests/test_gpu_command_buffer.py", then the same for sm80.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${OUT:-$(mktemp -d)}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
declare -a NAMES=() RESULTS=()
failed=0
verdict() {
  NAMES+=("$1"); RESULTS+=("$2")
  case "$2" in FAIL*) failed=1 ;; esac
}

if ! "$PY" -c "import cutlass_library" 2>/dev/null && ls .whl/nvidia_cutlass-*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/nvidia_cutlass-*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null); $(nvcc --version | tail -1); \
jax $("$PY" -c 'import jax; print(jax.__version__)' 2>/dev/null); commit $(git rev-parse --short HEAD 2>/dev/null)"
if [ -n "${WHEEL:-}" ]; then  # a wheel built by an earlier call (WHEEL_DIR there), carried here: no build
  if "$PY" -m pip install -q --no-deps --force-reinstall "$WHEEL" >"$LOG/build.log" 2>&1; then
    verdict build "ok (installed $(basename "$WHEEL"))"
  else
    tail -20 "$LOG/build.log"; verdict build "FAIL (see build.log)"
  fi
elif [ "${SKIP_BUILD:-0}" != 1 ]; then
  echo "== build ($(nproc) cores)"
  start=$(date +%s)
  build() {  # with WHEEL_DIR, a wheel there first (to carry to the next call), then installed
    # Both input dtypes whatever the environment says (CI narrows it): the GPU tests cover both.
    export JAXFLASH_CUDA=ON JAXFLASH_CUDA_DTYPES="bfloat16;float16" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
    if [ -z "${WHEEL_DIR:-}" ]; then
      "$PY" -m pip install --no-build-isolation --no-deps -v . && return
    fi
    "$PY" -m pip wheel --no-build-isolation --no-deps -v -w "$WHEEL_DIR" . &&
      "$PY" -m pip install -q --no-deps --force-reinstall "$WHEEL_DIR"/jaxflash-*.whl
  }
  if build >"$LOG/build.log" 2>&1; then
    verdict build "ok ($(( $(date +%s) - start )) s)"
  else
    grep -E "error" "$LOG/build.log" | head -20; tail -20 "$LOG/build.log"; verdict build "FAIL (see build.log)"
  fi
fi
cd /tmp  # import the installed package, not the source tree
REPO="$OLDPWD"

echo "== pytest -m gpu"
default_pytest_args=""
"$PY" -c "import xdist" 2>/dev/null && default_pytest_args="-n 4"
paths=()
for path in ${PYTEST_PATHS:-tests}; do paths+=("$REPO/$path"); done
# Two passes: the tests in parallel workers, then the bigmem ones (tens of GB each) alone in one process, since
# parallel workers' allocators keep what they grew (on an 80 GB H100 the backward's 64-bit test ran out of memory
# beside three workers). Exit status 5 of the second pass is "none selected" (paths without such tests).
"$PY" -m pytest -m "gpu and not bigmem" -q -p no:cacheprovider ${PYTEST_ARGS-$default_pytest_args} "${paths[@]}" \
  >"$LOG/pytest.log" 2>&1
rc_par=$?
"$PY" -m pytest -m "gpu and bigmem" -q -p no:cacheprovider "${paths[@]}" >"$LOG/pytest_bigmem.log" 2>&1
rc_big=$?
summary="$(tail -1 "$LOG/pytest.log"); bigmem: $(tail -1 "$LOG/pytest_bigmem.log")"
if [ $rc_par -eq 0 ] && { [ $rc_big -eq 0 ] || [ $rc_big -eq 5 ]; }; then
  if grep -Eq '[0-9]+ passed' "$LOG/pytest.log"; then
    verdict "pytest -m gpu" "ok: $summary"
  else  # every test skipped (no GPU, or no CUDA module): nothing was checked
    verdict "pytest -m gpu" "FAIL: no GPU test ran ($summary)"
  fi
else
  grep -hE "^(FAILED|ERROR)|Error|assert" "$LOG/pytest.log" "$LOG/pytest_bigmem.log" | head -30
  verdict "pytest -m gpu" "FAIL: $summary"
fi

cat >/tmp/jaxflash_small.py <<'PYEOF'
import jax, jax.numpy as jnp, numpy as np, jaxflash
rng = np.random.default_rng(0)
for dtype, d, sq, sk, hq, hk, causal in [("bfloat16", 64, 113, 203, 4, 2, True), ("float16", 128, 239, 77, 2, 1, True),
                                         ("bfloat16", 256, 130, 130, 2, 2, False), ("bfloat16", 32, 1, 1, 1, 1, False),
                                         ("bfloat16", 96, 200, 65, 3, 1, False), ("float16", 192, 65, 300, 2, 2, True)]:
    q = jnp.asarray(rng.standard_normal((2, sq, hq, d)), dtype)
    k = jnp.asarray(rng.standard_normal((2, sk, hk, d)), dtype)
    v = jnp.asarray(rng.standard_normal((2, sk, hk, d)), dtype)
    o = jaxflash.attention(q, k, v, causal=causal, backend="cuda")
    assert np.isfinite(np.asarray(o, np.float32)).all()
    for det in (False, True):
        _, vjp = jax.vjp(lambda q, k, v: jaxflash.attention(q, k, v, causal=causal, deterministic=det,
                                                            backend="cuda"), q, k, v)
        assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in vjp(jnp.ones_like(q)))
# Masks, softcap and dropout (the kernels' kExtras variant and the masked paths of the plain one).
q = jnp.asarray(rng.standard_normal((2, 150, 4, 128)), "bfloat16")
k = jnp.asarray(rng.standard_normal((2, 170, 2, 128)), "bfloat16")
ids_q = jnp.asarray(np.sort(rng.integers(0, 4, (2, 150))), jnp.int32)
ids_k = jnp.asarray(np.sort(rng.integers(0, 4, (2, 170))), jnp.int32)
for kw in [dict(window=(40, 3), q_lengths=jnp.array([150, 70]), kv_lengths=jnp.array([99, 170])),
           dict(causal=True, q_segment_ids=ids_q, kv_segment_ids=ids_k, softcap=5.0),
           dict(dropout_rate=0.2, dropout_key=jax.random.key(1), window=(None, 7))]:
    for det in (False, True):
        o, vjp = jax.vjp(lambda q, k, v: jaxflash.attention(q, k, v, deterministic=det, backend="cuda", **kw), q, k, k)
        assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in (o, *vjp(jnp.ones_like(q))))
# The decode kernel: keys split across thread blocks, packed GQA rows, lengths, masks, softcap, a paged cache.
q = jnp.asarray(rng.standard_normal((2, 2, 8, 128)), "bfloat16")
k = jnp.asarray(rng.standard_normal((2, 3008, 2, 128)), "bfloat16")
for kw in [dict(), dict(causal=True, kv_lengths=jnp.array([2999, 5]), softcap=5.0),
           dict(window=(100, 0), q_segment_ids=jnp.zeros((2, 2), jnp.int32),
                kv_segment_ids=jnp.asarray(rng.integers(0, 2, (2, 3008)), jnp.int32))]:
    assert np.isfinite(np.asarray(jaxflash.attention(q, k, k, backend="cuda", **kw), np.float32)).all()
cache, table = k.reshape(-1, 16, 2, 128), jnp.arange(376, dtype=jnp.int32).reshape(2, 188)
for n in (None, 1, 5):
    o = jaxflash.paged_attention(q, cache, cache, table, jnp.array([3008, 77], jnp.int32), causal=True, num_splits=n)
    assert np.isfinite(np.asarray(o, np.float32)).all()
print("small forward and backward cases ran")
PYEOF
# Each kernel family (JAXFLASH_TEST_FAMILIES, as for pytest): "auto" runs the sm90 kernels on a Hopper GPU.
for family in ${JAXFLASH_TEST_FAMILIES:-auto sm80}; do
  for tool in memcheck racecheck; do
    [ "${SKIP_SANITIZER:-0}" = 1 ] && break
    # racecheck reports a race only in a run where the accesses happen to interleave (one in the sm90 backward
    # showed in about every second run), so it runs RACECHECK_RUNS times; the log is that of the last run.
    runs=1
    [ "$tool" = racecheck ] && runs=${RACECHECK_RUNS:-3}
    log="$LOG/sanitizer_${tool}_$family.log"
    clean=1
    for run in $(seq "$runs"); do
      echo "== compute-sanitizer --tool $tool ($family, run $run of $runs)"
      if ! JAXFLASH_CUDA_KERNELS=$family timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 9 \
          --kernel-name kns=flash_ "$PY" /tmp/jaxflash_small.py >"$log" 2>&1; then
        clean=0
        break
      fi
    done
    summary="$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
    if [ $clean = 1 ]; then
      verdict "sanitizer $tool $family" "ok: $summary ($runs of $runs runs)"
    else
      tail -20 "$log"
      verdict "sanitizer $tool $family" "FAIL: $summary (run $run of $runs)"
    fi
  done
done

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  for suite in ${BENCH_SUITES:-targets masks dropout}; do
    echo "== benchmark ($suite)"
    # Exit 1 means an implementation disagreed with the float64 oracle or jaxflash itself failed.
    if timeout 400 "$PY" -m jaxflash.bench --suite "$suite" --out "$LOG/bench_$suite" ${BENCH_ARGS:-} 2>&1 \
        | tee "$LOG/bench_$suite.log"; then
      verdict "benchmark $suite" "ok (bench_$suite.log, bench_$suite/)"
    else
      verdict "benchmark $suite" "FAIL (bench_$suite.log)"
    fi
  done
fi

echo
echo "== verdict (logs: $LOG)"
for i in "${!NAMES[@]}"; do printf '%-22s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"; done
exit $failed
