"""`python -m jaxflash.bench` on the CPU: a tiny sweep against XLA's attention, its files, the interleaved timing,
the CPU targets, and the check that refuses a wrong kernel."""
import argparse
import csv
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import bench

TINY = ["--seqlens", "64", "128", "--head-dims", "32", "--heads", "2", "--reps", "1"]


def test_oracle_matches_autodiff_of_the_reference():
    """The bench's float64 oracle (o, dq, dk, dv) against jax.grad of jaxflash.reference, with GQA, a window,
    segment ids and softcap: the check is only as good as this."""
    case = bench.Case("mix", window=True, docs=3, softcap=5.0)
    q, k, v, do = bench.inputs(3, 2, 48, 4, 2, 16, jnp.float32, "fwdbwd")
    kw = case.kwargs(2, 48)
    o, vjp = jax.vjp(lambda q, k, v: jaxflash.reference.attention(q, k, v, **kw), q, k, v)
    mask = np.asarray(jaxflash.reference.visible(48, 48, window=kw["window"], q_segment_ids=kw["q_segment_ids"],
                                                 kv_segment_ids=kw["kv_segment_ids"]))
    want = bench.oracle(q, k, v, do, mask=mask, softcap=5.0)
    for got, ref in zip([o, *vjp(do)], want):
        np.testing.assert_allclose(np.asarray(got), ref, atol=2e-5, rtol=1e-4)


def test_cpu_sweep_writes_csv_json_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert bench.main(TINY + ["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("RESULT ") == 2 * 2 * 2 * 2  # passes x causal x seqlens x impls
    with open(tmp_path / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert {(r["impl"], r["pass_"], r["causal"], r["s"]) for r in rows} == {
        (i, p, c, s) for i in ("jaxflash", "xla") for p in ("fwd", "fwdbwd") for c in "01" for s in ("64", "128")}
    for r in rows:
        assert r["status"] == "ok" and float(r["check_err"]) < 1e-3 and r["method"] == "wall-interleaved"
        assert r["target"] == ""  # the CPU targets are for B=1, H=4 (this run has H=2)
        ms, tflops, s = float(r["ms"]), float(r["tflops"]), int(r["s"])
        flop = 4 * 1 * 2 * s * s * 32 * (0.5 if r["causal"] == "1" else 1) * (3.5 if r["pass_"] == "fwdbwd" else 1)
        assert ms > 0 and math.isclose(tflops * ms * 1e9, flop, rel_tol=1e-6)
        assert float(r["peak_mb"]) > 0
    by = {(r["impl"], r["pass_"], r["causal"], r["s"]): r for r in rows}
    for (impl, p, c, s), r in by.items():
        if impl == "jaxflash":  # speedup and memory saved are against XLA's row of the same config
            ref = by[("xla", p, c, s)]
            assert r["vs"] == "xla"
            assert math.isclose(float(r["speedup"]), float(ref["ms"]) / float(r["ms"]), rel_tol=1e-6)
            assert math.isclose(float(r["mem_saved"]), float(ref["peak_mb"]) / float(r["peak_mb"]), rel_tol=1e-6)
    # The materialised S x S scores show in XLA's memory, not in the kernel's.
    ref, flash = by[("xla", "fwd", "0", "128")], by[("jaxflash", "fwd", "0", "128")]
    assert float(ref["peak_mb"]) > float(flash["peak_mb"])
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["meta"]["backend"] == "cpu" and len(doc["rows"]) == len(rows)
    png = (tmp_path / "tflops.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def _broken_jaxflash(monkeypatch, attn):
    monkeypatch.setitem(bench.IMPLS, "jaxflash", (attn, None))


def test_a_wrong_implementation_is_caught_and_not_timed(monkeypatch, capsys):
    # Off by the softmax scale: a plausible bug, numerically close to right.
    _broken_jaxflash(monkeypatch, lambda q, k, v, kw: jaxflash.attention(q, k, v, scale=1.1 * q.shape[-1] ** -0.5,
                                                                         **kw))
    assert bench.main(TINY + ["--passes", "fwd"]) == 1
    captured = capsys.readouterr()
    assert "CHECK FAILED" in captured.out and "WRONG" in captured.err
    assert "RESULT suite=sweep case=full impl=jaxflash" not in captured.out
    assert "RESULT suite=sweep case=full impl=xla" in captured.out


def test_a_wrong_gradient_is_caught(monkeypatch, capsys):
    @jax.custom_vjp
    def attn(q, k, v):
        return jaxflash.attention(q, k, v)

    def bwd(res, do):  # forward right, dk wrong
        dq, dk, dv = jax.vjp(lambda q, k, v: jaxflash.attention(q, k, v), *res)[1](do)
        return dq, 0.5 * dk, dv

    attn.defvjp(lambda q, k, v: (attn(q, k, v), (q, k, v)), bwd)
    _broken_jaxflash(monkeypatch, lambda q, k, v, kw: attn(q, k, v))
    assert bench.main(TINY + ["--seqlens", "64", "--impls", "jaxflash"]) == 1
    out = capsys.readouterr().out
    assert "check jaxflash full fwd d=32: max rel error" in out and "ok" in out.split("fwd d=32")[1].splitlines()[0]
    assert "check jaxflash full fwdbwd" in out and "CHECK FAILED" in out


def test_a_mask_the_implementation_ignores_is_caught(monkeypatch, capsys):
    _broken_jaxflash(monkeypatch, lambda q, k, v, kw: jaxflash.attention(q, k, v, causal=kw["causal"]))
    assert bench.main(["--suite", "masks", "--seqlens", "64", "--head-dims", "32", "--heads", "2", "--reps", "1",
                       "--passes", "fwd", "--impls", "jaxflash"]) == 1
    out = capsys.readouterr().out
    for label, ok in (("full", True), ("causal", True), ("window", False), ("docs", False), ("softcap", False)):
        line = next(x for x in out.splitlines() if x.startswith(f"# check jaxflash {label} "))
        assert line.endswith("ok") == ok, line


def test_not_implemented_shows_as_na(monkeypatch, capsys):
    def attn(q, k, v, kw):
        if "dropout_rate" in kw:
            raise NotImplementedError("no dropout here")
        return jaxflash.attention(q, k, v, **kw)

    _broken_jaxflash(monkeypatch, attn)
    assert bench.main(["--suite", "dropout", "--seqlens", "64", "--head-dims", "32", "--heads", "2", "--reps", "1",
                       "--passes", "fwdbwd", "--impls", "jaxflash"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("dropout ")]
    assert len(lines) == 2 and "n/a" not in lines[0] and lines[1].endswith("n/a (not implemented)")


def _plan(gpu, **kw):
    args = argparse.Namespace(suite="sweep", impls=None, quick=False, head_dims=None, seqlens=None,
                              passes=["fwd"], batch=None, heads=None)
    vars(args).update(kw)
    return bench.plan(args, gpu=gpu)


def _gpu_plan(**kw):
    return _plan(True, **kw)


def test_cpu_default_sweep_is_jaxflash_against_xla_over_the_issue_grid():
    jobs = _plan(False, passes=list(bench.PASSES))
    assert {(j.pass_, j.d, j.s, j.case.label) for j in jobs} == {
        (p, d, s, c) for p in bench.PASSES for d in (64, 128) for s in (256, 1024, 2048, 4096)
        for c in ("full", "causal")}
    assert all(j.impls == ["jaxflash", "xla"] and j.base_impl == "xla" and (j.b, j.hq, j.hkv) == (1, 4, 4)
               for j in jobs)
    # The reference stays available; asked for without xla, it is the baseline.
    jobs = _plan(False, impls=["jaxflash", "reference"], seqlens=[256])
    assert jobs and all(j.base_impl == "reference" for j in jobs)
    assert all(j.base_impl == "xla" for j in _plan(False, impls=["jaxflash", "reference", "xla"], seqlens=[256]))


def test_cpu_timing_is_round_robin_with_a_rotating_first_call(monkeypatch):
    calls, clock = [], [0.0]

    def impl(i):  # a call of implementation i takes i + 1 ms on the fake clock
        def f(x):
            calls.append(i)
            clock[0] += (i + 1) * 1e-3
            return x
        return f

    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    ms = bench.interleaved_ms([(impl(i), (jnp.zeros(1),)) for i in range(3)], 3)
    assert calls == [0, 1, 2, 1, 2, 0, 2, 0, 1]  # one call of each per round, the first rotating
    assert ms == pytest.approx([1.0, 2.0, 3.0])  # the median per implementation


def _row(s, speedup, hq=4, impl="jaxflash", dtype="float32"):
    return dict(suite="sweep", case="full", impl=impl, pass_="fwd", d=64, s=s, b=1, hq=hq, hkv=hq, dtype=dtype,
                status="ok", ms=1.0 / speedup, peak_mb=1.0, tflops=1.0)


@pytest.mark.parametrize("s, speedup, hq, dtype, want", [
    (1024, 1.6, 4, "float32", ">= 1.5x: met"),
    (4096, 1.2, 4, "float32", ">= 1.5x: short 20.0%"),
    (256, 1.0, 4, "float32", ">= 1x: met"),
    (256, 0.9, 4, "float32", ">= 1x: short 10.0%"),
    (128, 2.0, 4, "float32", ""),  # no target below S=256
    (1024, 2.0, 2, "float32", ""),  # the targets are for H=4
    (1024, 2.0, 4, "bfloat16", ""),
], ids=lambda p: f"{p}")
def test_cpu_targets_are_speedups_over_xla(s, speedup, hq, dtype, want):
    flash, xla = _row(s, speedup, hq, dtype=dtype), _row(s, 1.0, hq, "xla", dtype)
    job = bench.Job("sweep", bench.FULL, "fwd", 1, hq, hq, s, 64, ["jaxflash", "xla"], base_impl="xla")
    bench._compare([flash, xla], [job], cpu=True)
    assert math.isclose(flash["speedup"], speedup) and flash["vs"] == "xla"
    assert flash["target"] == want and xla["target"] == ""


def test_cpu_run_prints_the_targets_vs_xla(capsys):
    assert bench.main(["--seqlens", "256", "--head-dims", "32", "--passes", "fwd", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith("sweep ") and " jaxflash " in x]
    assert len(lines) == 2 and all(" xla " in x and ">= 1x: " in x for x in lines)
    assert "CPU targets (speedup over XLA): " in out and " of 2 met" in out


def test_gqa_rows_leave_out_an_implementation_without_gqa(monkeypatch):
    monkeypatch.setitem(bench.IMPLS, "nogqa", (lambda q, k, v, kw: None, {"window"}))
    jobs = _gpu_plan(impls=["jaxflash", "nogqa", "cudnn"])
    gqa = [j for j in jobs if j.hq != j.hkv]
    assert gqa and all(j.impls == ["jaxflash", "cudnn"] for j in gqa)
    assert all("nogqa" in j.impls for j in jobs if j.hq == j.hkv and j.s <= 16384)


def test_seed_suite_times_standard_attention_last_as_the_baseline():
    jobs = _gpu_plan(suite="seed")
    assert jobs and all(j.impls[-1] == "xla" == j.base_impl and "reference" not in j.impls for j in jobs)


@pytest.mark.parametrize("impl", ["xla", "cudnn"])
def test_jax_nn_gets_a_right_side_0_window_as_causal(monkeypatch, impl):
    """jax.nn's cuDNN path silently differs for is_causal=False with local_window_size=(w, 0); the benchmark passes
    the same mask as is_causal=True, the form that agrees with jax.nn's XLA path."""
    seen = {}
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda q, k, v, **kw: seen.update(kw))
    q = jnp.zeros((1, 64, 2, 32))
    bench.IMPLS[impl][0](q, q, q, bench.Case("window", window=True).kwargs(1, 64))
    assert seen == dict(is_causal=True, local_window_size=(4, 0), implementation=impl)
    bench.IMPLS[impl][0](q, q, q, dict(causal=False, window=(4, 2)))
    assert (seen["is_causal"], seen["local_window_size"]) == (False, (4, 2))
    bench.IMPLS[impl][0](q, q, q, bench.CAUSAL.kwargs(1, 64))
    assert (seen["is_causal"], seen["local_window_size"]) == (True, None)


def test_gpu_targets_and_dropout_plans():
    """The targets suite holds every Hopper target shape; the dropout suite times the passes asked for."""
    jobs = _gpu_plan(suite="targets", passes=["fwd", "fwdbwd"])
    shapes = {(j.case.label, j.pass_, j.d, j.s) for j in jobs}
    assert {(c, p, d, s) for (suite, c, p, d, s) in bench.TARGETS if suite == "targets"} == shapes
    jobs = _gpu_plan(suite="dropout", passes=["fwd"])
    assert [(j.case.label, j.pass_) for j in jobs] == [("full", "fwd"), ("dropout", "fwd")]


def test_ring_suite_on_simulated_devices(capsys):
    """The ring suite times ring attention (both layouts) over every device against jaxflash on one, each first
    checked against the float64 oracle (8 simulated CPU devices here)."""
    assert jax.device_count() >= 2
    assert bench.main(["--suite", "ring", "--seqlens", "256", "--head-dims", "32", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    for impl in ("jaxflash", "ring-zigzag", "ring-contiguous"):
        for pass_ in ("fwd", "fwdbwd"):
            assert f"# check {impl} causal {pass_} d=32: " in out and "CHECK FAILED" not in out
            assert f"RESULT suite=ring case=causal impl={impl} pass={pass_} d=32 s=256 " in out


def test_ring_suite_needs_two_devices(monkeypatch):
    monkeypatch.setattr(bench.jax, "device_count", lambda: 1)
    with pytest.raises(SystemExit, match="two or more devices"):
        _plan(False, suite="ring")


def test_paged_copy_puts_each_token_in_its_page():
    k = jnp.arange(2 * 21 * 3 * 4, dtype=jnp.float32).reshape(2, 21, 3, 4)
    kc, vc, tables, lengths = bench.paged_copy(k, -k, 8)
    assert kc.shape == (6, 8, 3, 4) and tables.shape == (2, 3) and lengths.tolist() == [21, 21]
    assert sorted(np.asarray(tables).ravel().tolist()) == list(range(6))  # every page once, shuffled
    t = np.arange(21)
    for b in range(2):
        np.testing.assert_array_equal(np.asarray(kc)[np.asarray(tables)[b, t // 8], t % 8], np.asarray(k[b]))
        np.testing.assert_array_equal(np.asarray(vc)[np.asarray(tables)[b, t // 8], t % 8], -np.asarray(k[b]))


def test_decode_suite_checks_then_times_contiguous_and_paged(tmp_path, capsys):
    """Every implementation is checked against the oracle on a cache with a partial last page, then timed at
    Sq 1 and 4; the paged rows are compared with the contiguous one (no GPU targets on the CPU)."""
    argv = ["--suite", "decode", "--seqlens", "200", "--batch", "2", "--head-dims", "32", "--reps", "1"]
    assert bench.main(argv + ["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    impls = ("jaxflash", "jaxflash-paged16", "jaxflash-paged64", "xla")
    for impl in impls:
        assert f"# check {impl} decode d=32: " in out
        for sq in (1, 4):
            assert f"RESULT suite=decode impl={impl} d=32 b=2 sq={sq} sk=200 h=8 hkv=2 " in out
    assert "CHECK FAILED" not in out and "cudnn" not in out
    paged = [x for x in out.splitlines() if " jaxflash-paged" in x and "x contiguous" in x]
    assert len(paged) == 4 and not any(">=" in x for x in paged)
    rows = json.load(open(tmp_path / "results.json"))["rows"]
    assert {(r["impl"], r["sq"]) for r in rows} == {(i, sq) for i in impls for sq in (1, 4)}
    assert all(r["status"] == "ok" and r["gbps"] > 0 for r in rows)


def test_decode_suite_refuses_a_wrong_paged_kernel(monkeypatch, capsys):
    real = bench.paged_copy
    monkeypatch.setattr(bench, "paged_copy", lambda k, v, page, seed=0: real(k, v[:, ::-1], page, seed))
    assert bench.main(["--suite", "decode", "--seqlens", "64", "--head-dims", "16", "--reps", "1",
                       "--impls", "jaxflash", "jaxflash-paged16"]) == 1
    out = capsys.readouterr().out
    assert "# check jaxflash-paged16 decode d=16: " in out and "CHECK FAILED" in out
    assert "WRONG" in out
