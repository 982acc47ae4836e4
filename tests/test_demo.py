"""`python -m jaxflash.demo` in miniature: the jaxflash and standard-attention runs train alike."""
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

from jaxflash import demo  # noqa: E402


def test_text_ships_with_the_package():
    text = demo.load_text()
    assert len(text) > 30_000 and text.startswith("First Citizen:")


def test_loss_curves_agree_and_fall():
    cfg = demo.Config(width=32, heads=2, layers=1, seq=32, batch=8, steps=40, lr=1e-2)
    lines = []
    flash, standard, diff, tol = demo.run(cfg, every=10, out=lines.append)
    assert len(flash) == len(standard) == 40
    assert diff <= tol
    assert abs(flash[0] - standard[0]) <= 1e-5 * standard[0]  # same weights, same first batch
    assert flash[-5:].mean() < flash[0] - 0.8  # ln(58) = 4.06 at the start: it learns
    assert lines[-1].endswith("equal within tolerance")


GEN = demo.Config(width=32, heads=2, layers=2, seq=48, batch=8, steps=20, lr=1e-2)


def test_generation_through_the_paged_cache_matches_the_contiguous_cache_and_no_cache():
    lines = []
    paged, contiguous, agree = demo.run_generate(GEN, prompt_len=9, new_tokens=30, page_size=8, num_prompts=3,
                                                 out=lines.append)
    assert paged.shape == contiguous.shape == (3, 30)
    assert agree
    assert "tokens, paged vs contiguous cache: identical (90 of 90)" in lines
    assert "tokens, paged vs no cache: identical (90 of 90)" in lines


def test_generation_check_catches_a_wrong_cache(monkeypatch):
    # A paged attention that ignores causality lets the prompt see its future in the prefill: the tokens must
    # then differ from the contiguous cache's and the uncached model's, and the run must say so.
    real = demo.jaxflash.paged_attention
    monkeypatch.setattr(demo.jaxflash, "paged_attention", lambda *a, causal, **kw: real(*a, causal=False, **kw))
    lines = []
    _, _, agree = demo.run_generate(GEN, prompt_len=9, new_tokens=30, page_size=8, num_prompts=3,
                                    out=lines.append)
    assert not agree
    assert any(line.startswith("tokens, paged vs no cache:") and line.endswith("DIFFERENT") for line in lines)


@pytest.mark.parametrize("argv", [["--generate", "--seq", "16", "--prompt-len", "10", "--new-tokens", "7"],
                                  ["--generate", "--new-tokens", "0"], ["--generate", "--page-size", "12"]])
def test_generate_arguments_are_checked(argv, capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(argv)
    assert e.value.code == 2
    assert "--" in capsys.readouterr().err
